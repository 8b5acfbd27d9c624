//! The partitions a node holds right now, shared between the cluster coordinator (which
//! takes, renews, revokes and loses leases) and the engine (which claims, publishes and
//! settles only within them).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::partition::Fence;

#[derive(Clone, Copy, Debug)]
struct Held {
    epoch: i64,
    /// When the lease ends by this node's own clock, measured conservatively from before the
    /// statement that took or renewed it. After this the node does not publish the partition,
    /// whatever it has not heard yet (a node frozen by SIGSTOP wakes up past this).
    valid_until: Instant,
}

#[derive(Default)]
struct State {
    held: BTreeMap<i32, Held>,
    /// Held partitions being handed over, with the generation that revoked them: no new
    /// claims; released once the engine has seen that generation and holds none of their rows.
    revoking: BTreeMap<i32, u64>,
    /// Partitions with rows the engine still holds, as of generation `engine_seen`.
    busy: BTreeSet<i32>,
    /// The last generation the engine acted on (dropped the work it may no longer publish).
    engine_seen: u64,
}

type Callback = Box<dyn Fn() + Send + Sync>;

pub struct Ownership {
    count: u32,
    state: Mutex<State>,
    generation: AtomicU64,
    on_change: Mutex<Option<Callback>>,
}

impl Ownership {
    pub fn new(count: u32) -> Arc<Self> {
        Arc::new(Ownership {
            count,
            state: Mutex::default(),
            generation: AtomicU64::new(0),
            on_change: Mutex::new(None),
        })
    }

    pub fn count(&self) -> u32 {
        self.count
    }

    /// Grows with every change the coordinator makes.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Called after every change (the engine wakes up to claim or drop work).
    pub fn on_change(&self, callback: impl Fn() + Send + Sync + 'static) {
        *self.on_change.lock().unwrap_or_else(|p| p.into_inner()) = Some(Box::new(callback));
    }

    fn changed(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
        self.notify();
    }

    fn notify(&self) {
        if let Some(callback) = self
            .on_change
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            callback();
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn grant(&self, partition: i32, epoch: i64, valid_until: Instant) {
        self.state()
            .held
            .insert(partition, Held { epoch, valid_until });
        self.changed();
    }

    /// The lease runs on to `valid_until`. The engine is woken only if it had run out by
    /// the node's clock (it may publish the partition again): a renewal of a lease still
    /// valid changes nothing it does, and woke it to claim at every renewal (twice a second
    /// for a mapped table's lock), whatever its poll interval.
    pub fn renewed(&self, partition: i32, valid_until: Instant) {
        let lapsed = {
            let mut state = self.state();
            let Some(held) = state.held.get_mut(&partition) else {
                return;
            };
            let lapsed = held.valid_until <= Instant::now();
            held.valid_until = valid_until;
            lapsed
        };
        if lapsed {
            self.changed();
        } else {
            // Seen at the engine's next look: its deadlines move on.
            self.generation.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// The partition is gone (released, or taken by another node).
    pub fn remove(&self, partition: i32) {
        {
            let mut state = self.state();
            state.held.remove(&partition);
            state.revoking.remove(&partition);
        }
        self.changed();
    }

    /// Start handing the partition over: stop claiming it, let in-flight work settle.
    pub fn revoke(&self, partition: i32) {
        let mut state = self.state();
        if state.revoking.contains_key(&partition) {
            return;
        }
        // The generation this change creates: the engine must have seen it before the
        // partition counts as idle.
        let generation = self.generation.fetch_add(1, Ordering::AcqRel) + 1;
        state.revoking.insert(partition, generation);
        drop(state);
        self.notify();
    }

    /// The hand-over is no longer wanted.
    pub fn keep(&self, partition: i32) {
        if self.state().revoking.remove(&partition).is_some() {
            self.changed();
        }
    }

    /// Partitions held, with their epochs.
    pub fn held(&self) -> Vec<(i32, i64)> {
        self.state()
            .held
            .iter()
            .map(|(p, h)| (*p, h.epoch))
            .collect()
    }

    pub fn revoking(&self) -> Vec<i32> {
        self.state().revoking.keys().copied().collect()
    }

    /// Whether the engine may still publish the partition: it holds rows of it, or it has not
    /// yet acted on the partition's revocation (a head may be on its way to the sink). A
    /// partition is released only once this is false.
    pub fn is_busy(&self, partition: i32) -> bool {
        let state = self.state();
        state.busy.contains(&partition)
            || state
                .revoking
                .get(&partition)
                .is_some_and(|revoked| state.engine_seen < *revoked)
    }

    /// Whether the engine has acted on `generation` (and on every change before it).
    pub fn engine_has_seen(&self, generation: u64) -> bool {
        self.state().engine_seen >= generation
    }

    /// Reported by the engine: the partitions it holds rows of, after it acted on
    /// `generation` (dropped the queued work of partitions it may no longer publish).
    pub fn set_busy(&self, busy: BTreeSet<i32>, generation: u64) {
        let mut state = self.state();
        state.busy = busy;
        state.engine_seen = state.engine_seen.max(generation);
    }

    /// Until when the engine may wait for a sink's confirmation of events of `partitions`:
    /// the earliest end of their leases by this node's clock; `None` when one of them is no
    /// longer held (it may not publish it at all).
    pub fn publish_deadline(&self, partitions: &BTreeSet<i32>) -> Option<Instant> {
        let state = self.state();
        partitions
            .iter()
            .map(|p| state.held.get(p).map(|h| h.valid_until))
            .try_fold(None, |earliest: Option<Instant>, until| {
                let until = until?;
                Some(Some(earliest.map_or(until, |e| e.min(until))))
            })
            .flatten()
    }

    fn fence(&self, filter: impl Fn(i32, &Held) -> bool) -> Fence {
        let state = self.state();
        let (partitions, epochs) = state
            .held
            .iter()
            .filter(|(p, h)| filter(**p, h))
            .map(|(p, h)| (*p, h.epoch))
            .unzip();
        Fence {
            count: self.count,
            partitions,
            epochs,
        }
    }

    /// What the engine may claim: held, valid by its own clock, not being handed over.
    pub fn claim_fence(&self, now: Instant) -> Fence {
        let revoking = self.state().revoking.clone();
        self.fence(|p, h| h.valid_until > now && !revoking.contains_key(&p))
    }

    /// The partitions of `fence` (a claim's) no longer held at its epochs: a claim reads its
    /// rows in one snapshot, and by the time they come back a partition may have been handed
    /// over, published by its new owner, and taken back at a later epoch. Its rows are then
    /// older than what that owner published of their keys. Empty, as almost always, when
    /// nothing changed.
    pub fn gone_from(&self, fence: &Fence) -> BTreeSet<i32> {
        let state = self.state();
        fence
            .partitions
            .iter()
            .zip(&fence.epochs)
            .filter(|(p, epoch)| state.held.get(p).is_none_or(|held| held.epoch != **epoch))
            .map(|(p, _)| *p)
            .collect()
    }

    /// What settles are fenced with: every held partition at its epoch (the database
    /// decides whether the lease still stands).
    pub fn settle_fence(&self) -> Fence {
        self.fence(|_, _| true)
    }

    /// Partitions the engine may publish now (held, valid by its clock, not being handed
    /// over), and when that next changes by the clock.
    pub fn publishable(&self, now: Instant) -> (BTreeSet<i32>, Option<Instant>) {
        let state = self.state();
        let valid = state
            .held
            .iter()
            .filter(|(p, h)| h.valid_until > now && !state.revoking.contains_key(p));
        let partitions = valid.clone().map(|(p, _)| *p).collect();
        let next = valid.map(|(_, h)| h.valid_until).min();
        (partitions, next)
    }
}

impl std::fmt::Debug for Ownership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ownership")
            .field("count", &self.count)
            .field("held", &self.held())
            .field("revoking", &self.revoking())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_engine_has_seen_a_change_only_once_it_reports_acting_on_it() {
        let ownership = Ownership::new(1);
        ownership.grant(0, 1, Instant::now() + std::time::Duration::from_secs(3));
        ownership.remove(0);
        let removed = ownership.generation();
        assert!(!ownership.engine_has_seen(removed));
        ownership.set_busy(BTreeSet::new(), removed - 1);
        assert!(
            !ownership.engine_has_seen(removed),
            "a report from before the removal"
        );
        ownership.set_busy(BTreeSet::new(), removed);
        assert!(ownership.engine_has_seen(removed));
    }
    use std::time::Duration;

    /// A claim fenced at epoch 5 comes back after the partition was handed over and taken
    /// back at epoch 7: its rows are not of the partition as held now.
    #[test]
    fn a_claims_rows_are_held_only_at_the_epoch_it_was_fenced_with() {
        let o = Ownership::new(8);
        let later = Instant::now() + Duration::from_secs(10);
        o.grant(1, 5, later);
        o.grant(2, 3, later);
        let fence = o.claim_fence(Instant::now());
        assert!(o.gone_from(&fence).is_empty());
        o.remove(1);
        assert_eq!(o.gone_from(&fence), BTreeSet::from([1]), "lost");
        o.grant(1, 7, later);
        assert_eq!(
            o.gone_from(&fence),
            BTreeSet::from([1]),
            "taken again at a later epoch"
        );
        o.grant(4, 1, later);
        assert!(!o.gone_from(&fence).contains(&4), "never in the fence");
    }

    #[test]
    fn fences_follow_grants_revocations_and_the_clock() {
        let o = Ownership::new(8);
        let now = Instant::now();
        o.grant(1, 5, now + Duration::from_secs(10));
        o.grant(2, 7, now + Duration::from_secs(1));
        o.revoke(2);
        assert_eq!(
            o.claim_fence(now).partitions,
            vec![1],
            "no new claims on a revoked partition"
        );
        assert_eq!(
            o.settle_fence().epochs,
            vec![5, 7],
            "settles still fenced with both"
        );
        let later = now + Duration::from_secs(2);
        let (publishable, next) = o.publishable(later);
        assert_eq!(
            publishable.into_iter().collect::<Vec<_>>(),
            vec![1],
            "2 is revoked and ran out"
        );
        o.keep(2);
        assert_eq!(
            o.publishable(now).0.into_iter().collect::<Vec<_>>(),
            vec![1, 2]
        );
        assert_eq!(next, Some(now + Duration::from_secs(10)));
        let g = o.generation();
        o.remove(2);
        assert!(o.generation() > g);
        assert_eq!(o.held(), vec![(1, 5)]);
    }

    #[test]
    fn a_revoked_partition_stays_busy_until_the_engine_has_seen_the_revocation() {
        // The race: the engine reported "no rows of 3" just before the revocation, and is
        // about to hand a queued head of 3 to the sink.
        let o = Ownership::new(8);
        o.grant(3, 1, Instant::now() + Duration::from_secs(10));
        o.set_busy(BTreeSet::new(), o.generation());
        o.revoke(3);
        assert!(
            o.is_busy(3),
            "not released on a report older than the revocation"
        );
        let seen = o.generation();
        o.set_busy(BTreeSet::from([3]), seen);
        assert!(o.is_busy(3), "in-flight work of 3 settles first");
        o.set_busy(BTreeSet::new(), seen);
        assert!(!o.is_busy(3));
    }

    #[test]
    fn publishes_are_bounded_by_the_earliest_lease_of_their_partitions() {
        let o = Ownership::new(8);
        let now = Instant::now();
        o.grant(1, 1, now + Duration::from_secs(10));
        o.grant(2, 1, now + Duration::from_secs(4));
        assert_eq!(
            o.publish_deadline(&BTreeSet::from([1, 2])),
            Some(now + Duration::from_secs(4))
        );
        o.renewed(2, now + Duration::from_secs(12));
        assert_eq!(
            o.publish_deadline(&BTreeSet::from([1, 2])),
            Some(now + Duration::from_secs(10))
        );
        o.remove(1);
        assert_eq!(o.publish_deadline(&BTreeSet::from([1, 2])), None);
    }

    /// Each renewal woke the engine, which claimed at each: twice a second for a mapped
    /// table's lock, whatever the poll interval.
    #[test]
    fn a_renewal_wakes_the_engine_only_for_a_lease_that_had_run_out() {
        use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
        let o = Ownership::new(1);
        let wakes = Arc::new(AtomicUsize::new(0));
        let counted = wakes.clone();
        o.on_change(move || {
            counted.fetch_add(1, SeqCst);
        });
        let now = Instant::now();
        o.grant(0, 1, now + Duration::from_secs(10));
        assert_eq!(wakes.load(SeqCst), 1, "a grant wakes it");
        let before = o.generation();
        o.renewed(0, now + Duration::from_secs(20));
        assert_eq!(wakes.load(SeqCst), 1, "a renewal of a valid lease does not");
        assert!(
            o.generation() > before,
            "its deadlines move on at its next look"
        );
        o.grant(0, 1, now);
        o.renewed(0, now + Duration::from_secs(20));
        assert_eq!(
            wakes.load(SeqCst),
            3,
            "a lease that had run out may publish again"
        );
    }
}
