//! Per-key lanes: the in-memory half of the ordering guarantee.
//!
//! Every claimed row joins the lane of its ordering key, in `sequence_id` order. Only the
//! head of a lane is ever out (publishing, or being dead-lettered): its first row, or a run
//! of its first rows for a sink that stores a key's run as a prefix; the next rows go when
//! the head is confirmed or dead-lettered. When a head must retry, the rest of its lane is
//! released back to the store, where the head's future `available_at` blocks them, and the
//! key is *blocked* here until the retry is recorded and every claim that could have read
//! the rows before that is back (so a racing claim cannot slip a later row past the head).
//!
//! A row handed to a release (or retry) statement is out of every lane but, until the
//! statement commits, still this node's in the store, and the node's own rows never hold
//! back its claims of later rows of their key. So a later row of the key that a claim
//! returns goes back too, while the release runs and until every claim that began before
//! it reported has returned: such a claim may have read the store before the release
//! committed, and its rows would otherwise overtake the released one.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

use outbox_core::id_hash::IdMap;
use outbox_core::{Claimed, Event, SequenceId};

/// The lane a row belongs to: its ordering key, or under `--ordering none` the row itself.
/// Only [`Lanes::lane_of`] makes one, so a caller cannot address a lane by the wrong name.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct LaneKey(Arc<str>);

/// A lane is found by its key's text: its hash is the text's (`Arc<str>` hashes as `str`).
impl std::borrow::Borrow<str> for LaneKey {
    fn borrow(&self) -> &str {
        &self.0
    }
}

/// What [`Lanes::take_ready`] hands out: each ready lane's head.
#[derive(Debug, Default)]
pub struct Handout {
    /// Events to publish. A lane's head is its first row, or a run of its first rows where
    /// the publisher keeps a batch's events of one key in order
    /// ([`outbox_core::Publisher::max_events_per_key`]); a run's rows are consecutive here.
    pub publish: Vec<Arc<Event>>,
    /// Undecodable rows, each its lane's head alone: they go straight to the dead letters.
    pub undecodable: Vec<UndecodableHead>,
}

impl Handout {
    pub fn is_empty(&self) -> bool {
        self.publish.is_empty() && self.undecodable.is_empty()
    }
}

/// An undecodable row at the head of its lane.
#[derive(Clone, Debug)]
pub struct UndecodableHead {
    pub sequence_id: SequenceId,
    pub lane: LaneKey,
    pub destination: String,
    pub attempts: u32,
    pub reason: String,
}

#[derive(Default)]
struct Lane {
    queue: VecDeque<Claimed>,
    /// How many of the queue's first rows are handed out (0: the lane is free).
    handed_out: usize,
    /// Its partition was lost while rows were out: none goes out again.
    lost: bool,
    partition: i32,
}

/// How long claims may carry rows read before a statement about a key committed: a
/// retry's record (the key is blocked meanwhile) or a row's release (later rows of its
/// lane go back meanwhile). Claims are numbered as they start.
#[derive(Clone, Copy, Debug)]
enum Unseen {
    /// The statement has not reported back: any claim may have read before it.
    Running,
    /// It reported once `n` claims had started: claims numbered `<= n` may have.
    ReportedAfterClaim(u64),
}

impl Unseen {
    fn by_claim(self, claim_no: u64) -> bool {
        match self {
            Unseen::Running => true,
            Unseen::ReportedAfterClaim(n) => claim_no <= n,
        }
    }

    /// Whether a claim still out (numbered above `claims_finished`) may have read before it.
    fn by_a_claim_still_out(self, claims_finished: u64) -> bool {
        match self {
            Unseen::Running => true,
            Unseen::ReportedAfterClaim(n) => n >= claims_finished,
        }
    }
}

/// A row this node leases and has not settled.
struct Held {
    partition: i32,
    lane: LaneKey,
    /// What the row costs in memory while held ([`outbox_core::memory::event_bytes`]).
    bytes: usize,
}

/// What a claimed row costs in memory while held.
fn row_bytes(row: &Claimed) -> usize {
    match row {
        Claimed::Event(e) => outbox_core::memory::event_bytes(e),
        Claimed::Undecodable {
            ordering_key,
            destination,
            reason,
            ..
        } => {
            outbox_core::memory::EVENT_OVERHEAD
                + ordering_key.len()
                + destination.len()
                + reason.len()
        }
    }
}

/// A held row handed to release (or retry) statements that have not all reported back.
struct Releasing {
    lane: LaneKey,
    /// Statements in flight that release the row: a row can be released, claimed again
    /// (one of them committed) and released again before either reports.
    statements: u32,
    /// A claim took the row again since it was last released: it is in a lane, and the
    /// reports must not forget it.
    claimed_again: bool,
}

#[derive(Default)]
pub struct Lanes {
    lanes: HashMap<LaneKey, Lane>,
    ready: VecDeque<LaneKey>,
    blocked: HashMap<LaneKey, Unseen>,
    /// Every row this node leases and has not settled (for lease extension and release),
    /// with its partition and lane.
    held: IdMap<Held>,
    /// The bytes of the held rows.
    held_bytes: usize,
    /// The largest row of the last claim: what the next claim expects each row to cost.
    last_claims_largest: Option<usize>,
    /// Held rows per partition, when the node holds partitions.
    busy: HashMap<i32, usize>,
    /// Held rows handed to release statements that have not all reported back.
    releasing: IdMap<Releasing>,
    /// Released rows in no lane, by lane, that a claim may not have seen go back: a
    /// claimed row of the lane above one of them goes back as well.
    released_by_lane: HashMap<LaneKey, BTreeMap<SequenceId, Unseen>>,
    /// `Some(count)` when rows are spread over partitions (a cluster).
    partition_count: Option<u32>,
    /// `false` for `--ordering none`: every row is its own lane.
    ordered: bool,
}

impl Lanes {
    pub fn new(ordered: bool, partition_count: Option<u32>) -> Self {
        Lanes {
            ordered,
            partition_count,
            ..Lanes::default()
        }
    }

    /// The lane of the row `sequence_id` with `ordering_key`.
    pub fn lane_of(&self, sequence_id: SequenceId, ordering_key: &str) -> LaneKey {
        if self.ordered {
            LaneKey(Arc::from(ordering_key))
        } else {
            LaneKey(Arc::from(sequence_id.to_string()))
        }
    }

    /// The lane of the held row `sequence_id`, as [`Lanes::lane_of`] made it when the row
    /// joined it: found, not made again (no allocation on the path of every outcome).
    pub fn lane_of_held(&self, sequence_id: SequenceId) -> Option<LaneKey> {
        self.held.get(&sequence_id).map(|held| held.lane.clone())
    }

    /// [`Lanes::lane_of`], sharing the key of the key's lane when it has one.
    fn lane_joined(&self, sequence_id: SequenceId, ordering_key: &str) -> LaneKey {
        if self.ordered {
            if let Some((key, _)) = self.lanes.get_key_value(ordering_key) {
                return key.clone();
            }
        }
        self.lane_of(sequence_id, ordering_key)
    }

    /// Partitions with held rows.
    pub fn busy_partitions(&self) -> std::collections::BTreeSet<i32> {
        self.busy.keys().copied().collect()
    }

    /// Drops every queued row of partitions not in `keep` (their lanes' in-flight heads
    /// finish); returns the rows to release.
    pub fn keep_only_partitions(
        &mut self,
        keep: &std::collections::BTreeSet<i32>,
    ) -> Vec<SequenceId> {
        let mut release = Vec::new();
        self.lanes.retain(|_, lane| {
            lane.lost = !keep.contains(&lane.partition);
            if !lane.lost {
                return true;
            }
            let skip = lane.handed_out;
            release.extend(lane.queue.iter().skip(skip).map(Claimed::sequence_id));
            lane.queue.truncate(skip);
            skip > 0
        });
        let lanes = &self.lanes;
        self.ready.retain(|k| lanes.contains_key(k));
        release
    }
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// The bytes the held rows cost in memory.
    pub fn held_bytes(&self) -> usize {
        self.held_bytes
    }

    /// The largest row of the last claim that returned rows.
    pub fn last_claims_largest(&self) -> Option<usize> {
        self.last_claims_largest
    }

    pub fn held_ids(&self) -> Vec<SequenceId> {
        self.held.keys().copied().collect()
    }

    pub fn has_ready(&self) -> bool {
        !self.ready.is_empty()
    }

    /// The keys holding `share` rows or more, which the next claim leaves out: a key slow
    /// to confirm (a receiver answering in seconds) would otherwise fill the node with its
    /// backlog, every other key waiting in the table. None under `--ordering none`, whose
    /// lanes are rows.
    pub fn crowded_keys(&self, share: usize) -> Vec<String> {
        if !self.ordered || self.held() < share {
            return Vec::new();
        }
        let mut keys: Vec<String> = self
            .lanes
            .iter()
            .filter(|(_, lane)| lane.queue.len() >= share)
            .map(|(key, _)| key.0.to_string())
            .collect();
        keys.sort();
        keys
    }

    /// Rows the lane of `key` holds.
    pub fn lane_rows(&self, key: &str) -> usize {
        self.lanes.get(key).map_or(0, |lane| lane.queue.len())
    }

    /// Rows queued behind a head, not yet handed out.
    pub fn queued(&self) -> usize {
        self.lanes.values().map(|l| l.queue.len()).sum()
    }

    /// Adds the rows of claim number `claim_no` (sorted by `sequence_id`). Returns the rows
    /// to release at once because their key is blocked.
    pub fn accept(&mut self, claim_no: u64, claimed: Vec<Claimed>) -> Vec<SequenceId> {
        let mut release = Vec::new();
        let largest = claimed.iter().map(row_bytes).max();
        if largest.is_some() {
            self.last_claims_largest = largest;
        }
        for row in claimed {
            let seq = row.sequence_id();
            let bytes = row_bytes(&row);
            let partition = self
                .partition_count
                .map_or(0, |n| outbox_core::partition_of(row.ordering_key(), n));
            let key = self.lane_joined(seq, row.ordering_key());
            let newly_held = match self.held.entry(seq) {
                std::collections::hash_map::Entry::Occupied(_) => false,
                std::collections::hash_map::Entry::Vacant(slot) => {
                    slot.insert(Held {
                        partition,
                        lane: key.clone(),
                        bytes,
                    });
                    self.held_bytes += bytes;
                    true
                }
            };
            if newly_held {
                if self.partition_count.is_some() {
                    *self.busy.entry(partition).or_default() += 1;
                }
                // Released, reported, and claimed again: the claim saw it, and it is in a
                // lane now.
                self.unmark_released(&key, seq);
            } else {
                match self.releasing.get_mut(&seq) {
                    Some(r) if !r.claimed_again => {
                        // Released, and claimed again before the release reported back: a
                        // new row.
                        r.claimed_again = true;
                        self.unmark_released(&key, seq);
                    }
                    // Still in a lane or in flight: the claim only renewed an expired lease.
                    _ => continue,
                }
            }
            // Most claims meet no released row: no lookup then, on the path of every row.
            let overtakes_a_release = !self.released_by_lane.is_empty()
                && self.released_by_lane.get(&key).is_some_and(|marks| {
                    marks
                        .range(..seq)
                        .any(|(_, released)| released.by_claim(claim_no))
                });
            if overtakes_a_release {
                release.push(seq);
                continue;
            }
            match self.blocked.get(&key) {
                Some(block) if block.by_claim(claim_no) => {
                    release.push(seq);
                    continue;
                }
                Some(_) => {
                    self.blocked.remove(&key);
                }
                None => {}
            }
            let lane = self.lanes.entry(key.clone()).or_default();
            lane.partition = partition;
            let was_idle = lane.handed_out == 0 && lane.queue.is_empty();
            lane.queue.push_back(row);
            if was_idle {
                self.ready.push_back(key);
            }
        }
        release
    }

    /// Hands out lane heads, up to `max_rows` rows in all, and marks their lanes busy. A
    /// head is a run of up to `per_lane` of its lane's first rows; an undecodable row is a
    /// head of its own.
    pub fn take_ready(&mut self, max_rows: usize, per_lane: usize) -> Handout {
        let mut handout = Handout::default();
        let mut rows = 0;
        while rows < max_rows {
            let Some(key) = self.ready.pop_front() else {
                break;
            };
            let Some(lane) = self.lanes.get_mut(&key) else {
                continue;
            };
            lane.handed_out = match lane.queue.front() {
                None => continue,
                Some(Claimed::Event(_)) => {
                    let before = handout.publish.len();
                    handout.publish.extend(
                        lane.queue
                            .iter()
                            .take(per_lane.clamp(1, max_rows - rows))
                            .map_while(|row| match row {
                                Claimed::Event(e) => Some(e.clone()),
                                Claimed::Undecodable { .. } => None,
                            }),
                    );
                    handout.publish.len() - before
                }
                Some(Claimed::Undecodable {
                    sequence_id,
                    destination,
                    attempts,
                    reason,
                    ..
                }) => {
                    handout.undecodable.push(UndecodableHead {
                        sequence_id: *sequence_id,
                        lane: key.clone(),
                        destination: destination.clone(),
                        attempts: *attempts,
                        reason: reason.clone(),
                    });
                    1
                }
            };
            rows += lane.handed_out;
        }
        handout
    }

    /// The first `n` rows handed out from `key` were confirmed, in order. Once every row
    /// handed out is, the lane is free and its next rows may go.
    pub fn confirmed(&mut self, key: &LaneKey, n: usize) {
        let Some(lane) = self.lanes.get_mut(key) else {
            return;
        };
        let n = n.min(lane.handed_out);
        lane.queue.drain(..n);
        lane.handed_out -= n;
        if lane.handed_out == 0 {
            self.free(key);
        }
    }

    /// The head row of `key` is done (dead-lettered): the next row may go. Rows of its run
    /// behind it count as not handed out: they go out again, or, if the lane's partition
    /// was lost meanwhile, are returned to release.
    pub fn advance(&mut self, key: &LaneKey) -> Vec<SequenceId> {
        let Some(lane) = self.lanes.get_mut(key) else {
            return Vec::new();
        };
        lane.queue.pop_front();
        lane.handed_out = 0;
        if lane.lost {
            return self.give_back(key);
        }
        self.free(key);
        Vec::new()
    }

    /// The sink did not send `key`'s head ([`outbox_core::PublishErrorKind::NotSent`]): drops
    /// the lane. Returns its rows, head first, to release: they go out again, no attempt
    /// counted.
    pub fn give_back(&mut self, key: &LaneKey) -> Vec<SequenceId> {
        self.lanes.remove(key).map_or_else(Vec::new, |lane| {
            lane.queue.iter().map(Claimed::sequence_id).collect()
        })
    }

    /// `key` has nothing handed out: gone if empty, else ready.
    fn free(&mut self, key: &LaneKey) {
        if self
            .lanes
            .get(key)
            .is_some_and(|lane| lane.queue.is_empty())
        {
            self.lanes.remove(key);
        } else {
            self.ready.push_back(key.clone());
        }
    }

    /// The head row of `key` must retry: drops the lane and blocks the key until
    /// [`Lanes::retry_recorded`]. Returns the rows behind the head row (those of its run
    /// too), to release.
    pub fn block(&mut self, key: &LaneKey) -> Vec<SequenceId> {
        self.blocked.insert(key.clone(), Unseen::Running);
        let Some(mut lane) = self.lanes.remove(key) else {
            return Vec::new();
        };
        lane.queue.pop_front();
        lane.queue.iter().map(Claimed::sequence_id).collect()
    }

    /// The retry of `key`'s head is recorded; `claims_started` claims had begun by then.
    pub fn retry_recorded(&mut self, key: &LaneKey, claims_started: u64) {
        if let Some(block) = self.blocked.get_mut(key) {
            *block = Unseen::ReportedAfterClaim(claims_started);
        }
    }

    /// Drops blocks, and marks of released rows, that no claim can be affected by any more.
    pub fn expire_blocks(&mut self, claims_finished: u64) {
        self.blocked
            .retain(|_, block| block.by_a_claim_still_out(claims_finished));
        self.released_by_lane.retain(|_, marks| {
            marks.retain(|_, released| released.by_a_claim_still_out(claims_finished));
            !marks.is_empty()
        });
    }

    /// These held rows are being released (or retried) by a statement: each must be
    /// reported back once through [`Lanes::forget_released`].
    pub fn releasing(&mut self, ids: &[SequenceId]) {
        for &id in ids {
            let Some(lane) = self.held.get(&id).map(|h| h.lane.clone()) else {
                continue;
            };
            let entry = self.releasing.entry(id).or_insert(Releasing {
                lane: lane.clone(),
                statements: 0,
                claimed_again: false,
            });
            entry.statements += 1;
            entry.claimed_again = false;
            self.released_by_lane
                .entry(lane)
                .or_default()
                .insert(id, Unseen::Running);
        }
    }

    /// A release reported back, once `claims_started` claims had begun: forget the rows no
    /// claim has taken again since, once no other release of them is in flight.
    pub fn forget_released(&mut self, ids: &[SequenceId], claims_started: u64) {
        let mut gone = Vec::new();
        for &id in ids {
            let std::collections::hash_map::Entry::Occupied(mut entry) = self.releasing.entry(id)
            else {
                continue;
            };
            debug_assert!(entry.get().statements > 0);
            entry.get_mut().statements -= 1;
            if entry.get().statements > 0 {
                continue;
            }
            let Releasing {
                lane,
                claimed_again,
                ..
            } = entry.remove();
            if !claimed_again {
                if let Some(mark) = self
                    .released_by_lane
                    .get_mut(&lane)
                    .and_then(|marks| marks.get_mut(&id))
                {
                    *mark = Unseen::ReportedAfterClaim(claims_started);
                }
                gone.push(id);
            }
        }
        self.forget(&gone);
    }

    fn unmark_released(&mut self, lane: &LaneKey, id: SequenceId) {
        if self.released_by_lane.is_empty() {
            return;
        }
        if let Some(marks) = self.released_by_lane.get_mut(lane) {
            marks.remove(&id);
            if marks.is_empty() {
                self.released_by_lane.remove(lane);
            }
        }
    }

    /// Rows whose settle statement succeeded are no longer held.
    pub fn forget(&mut self, ids: &[SequenceId]) {
        for id in ids {
            if let Some(held) = self.held.remove(id) {
                self.held_bytes -= held.bytes;
                if let Some(n) = self.busy.get_mut(&held.partition) {
                    *n -= 1;
                    if *n == 0 {
                        self.busy.remove(&held.partition);
                    }
                }
            }
        }
    }

    /// Everything still queued and not handed out, taken out of the lanes: what a
    /// shutdown may release. A row handed out may still reach the sink (a publish abandoned
    /// at the deadline, a producer flushing as it closes): released, another node could
    /// send it again ahead of it, after the key's next event. It keeps its lease instead,
    /// and comes back when the lease runs out.
    pub fn take_unstarted(&mut self) -> Vec<SequenceId> {
        let mut ids = Vec::new();
        for lane in self.lanes.values_mut() {
            let skip = lane.handed_out;
            ids.extend(lane.queue.iter().skip(skip).map(Claimed::sequence_id));
            lane.queue.truncate(skip);
        }
        self.ready.clear();
        ids
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_core::Payload;

    pub(super) fn row(seq: i64, key: &str) -> Claimed {
        Claimed::Event(Arc::new(Event {
            partition_key: Some(key.into()),
            ..Event::new(seq, uuid::Uuid::nil(), "d", "t", Payload::Null)
        }))
    }

    /// The rows handed out: the events to publish, then the undecodable rows.
    pub(super) fn seqs(handout: &Handout) -> Vec<i64> {
        let publish = handout.publish.iter().map(|e| e.sequence_id);
        publish
            .chain(handout.undecodable.iter().map(|u| u.sequence_id))
            .collect()
    }

    /// Keys holding their share are crowded; a handed-out head still counts (it is held),
    /// a confirmed one no longer does. Under `--ordering none` no key is.
    #[test]
    fn keys_holding_their_share_are_crowded() {
        let mut lanes = Lanes::new(true, None);
        assert!(lanes.crowded_keys(3).is_empty());
        let rows = [(1, "a"), (2, "a"), (3, "a"), (4, "b"), (5, "c"), (6, "c")];
        lanes.accept(1, rows.iter().map(|(n, k)| row(*n, k)).collect());
        assert_eq!(lanes.crowded_keys(3), ["a"]);
        assert_eq!(lanes.crowded_keys(2), ["a", "c"]);
        assert!(lanes.crowded_keys(4).is_empty(), "below the share");
        let handout = lanes.take_ready(10, 1);
        assert_eq!(seqs(&handout), [1, 4, 5]);
        assert_eq!(lanes.crowded_keys(3), ["a"], "a head out is still held");
        lanes.confirmed(&lanes.lane_of(1, "a"), 1);
        assert!(lanes.crowded_keys(3).is_empty());
        assert_eq!(lanes.lane_rows("a"), 2);

        let mut unordered = Lanes::new(false, None);
        unordered.accept(1, (1..=4).map(|n| row(n, "a")).collect());
        assert!(unordered.crowded_keys(1).is_empty(), "lanes are rows");
    }

    /// A held row's lane is found, not made again, and the rows of one key share one key
    /// (made once, not per row); under `--ordering none` each row is a lane of its own.
    #[test]
    fn held_rows_name_the_lane_they_joined() {
        let mut lanes = Lanes::new(true, None);
        lanes.accept(1, vec![row(1, "a"), row(2, "a"), row(3, "b")]);
        let (one, two) = (
            lanes.lane_of_held(1).unwrap(),
            lanes.lane_of_held(2).unwrap(),
        );
        assert_eq!(one, lanes.lane_of(1, "a"));
        assert!(Arc::ptr_eq(&one.0, &two.0), "one key for the lane's rows");
        assert_eq!(lanes.lane_of_held(3), Some(lanes.lane_of(3, "b")));
        assert_eq!(lanes.lane_of_held(4), None, "not held");

        let mut unordered = Lanes::new(false, None);
        unordered.accept(1, vec![row(1, "a"), row(2, "a")]);
        assert_eq!(unordered.lane_of_held(2), Some(unordered.lane_of(2, "a")));
        assert_ne!(unordered.lane_of_held(1), unordered.lane_of_held(2));
    }

    #[test]
    fn one_head_per_key_in_sequence_order() {
        let mut lanes = Lanes::new(true, None);
        lanes.accept(1, vec![row(1, "a"), row(2, "b"), row(3, "a"), row(4, "a")]);
        assert_eq!(seqs(&lanes.take_ready(100, 1)), vec![1, 2]);
        assert!(lanes.take_ready(100, 1).is_empty(), "heads are out");
        lanes.advance(&lanes.lane_of(0, "a"));
        assert_eq!(seqs(&lanes.take_ready(100, 1)), vec![3]);
        lanes.advance(&lanes.lane_of(0, "a"));
        lanes.advance(&lanes.lane_of(0, "b"));
        assert_eq!(seqs(&lanes.take_ready(100, 1)), vec![4]);
    }

    fn undecodable(seq: i64, key: &str) -> Claimed {
        Claimed::Undecodable {
            sequence_id: seq,
            ordering_key: key.into(),
            destination: "d".into(),
            attempts: 0,
            reason: "bad".into(),
        }
    }

    #[test]
    fn a_head_is_a_run_of_its_lanes_first_rows_within_the_row_budget() {
        let mut lanes = Lanes::new(true, None);
        lanes.accept(
            1,
            vec![
                row(1, "a"),
                row(2, "b"),
                row(3, "a"),
                row(4, "a"),
                row(5, "a"),
            ],
        );
        assert_eq!(
            seqs(&lanes.take_ready(5, 3)),
            vec![1, 3, 4, 2],
            "a's run of three, then b's row: the budget's last"
        );
        lanes.accept(2, vec![row(6, "a")]);
        assert!(
            lanes.take_ready(5, 3).is_empty(),
            "rows behind a run wait for it"
        );
        lanes.confirmed(&lanes.lane_of(0, "a"), 3);
        assert_eq!(
            seqs(&lanes.take_ready(1, 3)),
            vec![5],
            "the budget cuts a run"
        );
    }

    #[test]
    fn a_run_stops_before_an_undecodable_row_which_goes_alone() {
        let mut lanes = Lanes::new(true, None);
        lanes.accept(1, vec![row(1, "a"), undecodable(2, "a"), row(3, "a")]);
        assert_eq!(seqs(&lanes.take_ready(10, 10)), vec![1]);
        lanes.confirmed(&lanes.lane_of(0, "a"), 1);
        let handout = lanes.take_ready(10, 10);
        assert!(handout.publish.is_empty());
        assert!(matches!(
            handout.undecodable[..],
            [UndecodableHead { sequence_id: 2, .. }]
        ));
        lanes.advance(&lanes.lane_of(0, "a"));
        assert_eq!(seqs(&lanes.take_ready(10, 10)), vec![3]);
    }

    /// Race: a run's second row fails after its first was confirmed. The lane stays busy
    /// (nothing of the key may overtake the failed row), and retrying releases the rest of
    /// the run with the rows queued behind it.
    #[test]
    fn a_run_failing_part_way_releases_what_follows_the_failed_row() {
        let mut lanes = Lanes::new(true, None);
        lanes.accept(1, vec![row(1, "a"), row(2, "a"), row(3, "a"), row(4, "a")]);
        assert_eq!(seqs(&lanes.take_ready(10, 3)), vec![1, 2, 3]);
        let a = lanes.lane_of(0, "a");
        lanes.confirmed(&a, 1);
        assert!(
            lanes.take_ready(10, 3).is_empty(),
            "row 2 failed: nothing overtakes it"
        );
        assert_eq!(lanes.block(&a), vec![3, 4]);
    }

    /// Race: as above, but the failed row is dead-lettered: once that settles, the rest of
    /// its run goes out again (the sink may hold it already: a duplicate, in order).
    #[test]
    fn a_run_whose_row_is_dead_lettered_hands_out_the_rest_again() {
        let mut lanes = Lanes::new(true, None);
        lanes.accept(1, vec![row(1, "a"), row(2, "a"), row(3, "a")]);
        assert_eq!(seqs(&lanes.take_ready(10, 3)), vec![1, 2, 3]);
        let a = lanes.lane_of(0, "a");
        lanes.confirmed(&a, 1);
        let mut unstarted = lanes.take_unstarted();
        assert!(
            unstarted.is_empty(),
            "a run in flight is not unstarted: {unstarted:?}"
        );
        lanes.advance(&a);
        assert_eq!(seqs(&lanes.take_ready(10, 3)), vec![3]);
        unstarted = lanes.take_unstarted();
        assert!(unstarted.is_empty());
    }

    /// Race: the partition of a run whose row is being dead-lettered is lost. The rest of
    /// the run stays this node's until the dead letter settles, then goes back: another
    /// node owns the key now.
    #[test]
    fn a_run_on_a_lost_partition_goes_back_once_its_dead_letter_settles() {
        let mut lanes = Lanes::new(true, Some(4));
        lanes.accept(1, vec![row(1, "a"), row(2, "a"), row(3, "a")]);
        assert_eq!(seqs(&lanes.take_ready(10, 3)), vec![1, 2, 3]);
        let a = lanes.lane_of(0, "a");
        lanes.confirmed(&a, 1);
        assert!(lanes.keep_only_partitions(&Default::default()).is_empty());
        assert_eq!(lanes.advance(&a), vec![3]);
        assert!(lanes.take_ready(10, 3).is_empty());
    }

    #[test]
    fn rows_claimed_later_queue_behind_the_busy_head() {
        let mut lanes = Lanes::new(true, None);
        lanes.accept(1, vec![row(1, "a")]);
        assert_eq!(seqs(&lanes.take_ready(10, 1)), vec![1]);
        lanes.accept(2, vec![row(5, "a")]);
        assert!(lanes.take_ready(10, 1).is_empty());
        lanes.advance(&lanes.lane_of(0, "a"));
        assert_eq!(seqs(&lanes.take_ready(10, 1)), vec![5]);
    }

    #[test]
    fn a_retrying_head_releases_its_lane_and_blocks_stale_claims() {
        let mut lanes = Lanes::new(true, None);
        lanes.accept(1, vec![row(1, "a"), row(2, "a"), row(3, "b")]);
        lanes.take_ready(10, 1);
        assert_eq!(lanes.block(&lanes.lane_of(0, "a")), vec![2]);
        // A claim racing the retry write returns row 6 of key a: released, not queued.
        assert_eq!(lanes.accept(2, vec![row(6, "a")]), vec![6]);
        lanes.retry_recorded(&lanes.lane_of(0, "a"), 3); // claim 3 started before the write finished
        assert_eq!(lanes.accept(3, vec![row(7, "a")]), vec![7]);
        lanes.expire_blocks(3);
        // Claim 4 began after the retry was recorded: the store's own blocking applies.
        assert!(lanes.accept(4, vec![row(8, "a")]).is_empty());
        lanes.advance(&lanes.lane_of(0, "b"));
        assert_eq!(seqs(&lanes.take_ready(10, 1)), vec![8]);
    }

    #[test]
    fn duplicate_claims_of_held_rows_are_ignored() {
        let mut lanes = Lanes::new(true, None);
        lanes.accept(1, vec![row(1, "a")]);
        lanes.take_ready(10, 1);
        lanes.advance(&lanes.lane_of(0, "a"));
        lanes.accept(2, vec![row(1, "a")]);
        assert!(lanes.take_ready(10, 1).is_empty());
        lanes.forget(&[1]);
        assert_eq!(lanes.held(), 0);
    }

    #[test]
    fn shutdown_takes_only_rows_not_handed_out() {
        let mut lanes = Lanes::new(true, None);
        lanes.accept(1, vec![row(1, "a"), row(2, "a"), row(3, "b")]);
        lanes.take_ready(1, 1);
        let mut ids = lanes.take_unstarted();
        ids.sort();
        assert_eq!(ids, vec![2, 3]);
    }

    #[test]
    fn unordered_lanes_send_every_row_at_once() {
        let mut lanes = Lanes::new(false, None);
        lanes.accept(1, vec![row(1, "a"), row(2, "a"), row(3, "a")]);
        assert_eq!(seqs(&lanes.take_ready(10, 1)), vec![1, 2, 3]);
    }

    #[test]
    fn unordered_lanes_are_gone_once_their_row_is_confirmed() {
        let mut lanes = Lanes::new(false, None);
        lanes.accept(1, vec![row(1, "a"), row(2, "a")]);
        assert_eq!(seqs(&lanes.take_ready(10, 1)), vec![1, 2]);
        lanes.advance(&lanes.lane_of(1, "a"));
        lanes.advance(&lanes.lane_of(2, "a"));
        lanes.forget(&[1, 2]);
        assert_eq!(lanes.queued(), 0, "confirmed rows stay in no lane");
        assert!(lanes.lanes.is_empty());
    }

    #[test]
    fn unordered_retry_claimed_again_by_the_same_node_goes_out_again() {
        // The head fails; its retry statement releases it; once due, this node's own claim
        // takes it again. It must be handed out, not queued behind its own old attempt.
        let mut lanes = Lanes::new(false, None);
        lanes.accept(1, vec![row(1, "a")]);
        assert_eq!(seqs(&lanes.take_ready(10, 1)), vec![1]);
        let lane = lanes.lane_of(1, "a");
        assert!(lanes.block(&lane).is_empty());
        lanes.releasing(&[1]);
        lanes.retry_recorded(&lane, 1);
        lanes.forget_released(&[1], 1);
        assert!(lanes.accept(2, vec![row(1, "a")]).is_empty());
        lanes.expire_blocks(2);
        assert_eq!(seqs(&lanes.take_ready(10, 1)), vec![1]);
    }

    #[test]
    fn lost_partitions_drop_their_queued_rows_and_busy_counts_follow() {
        let mut lanes = Lanes::new(true, Some(4));
        let rows: Vec<_> = (0..40).map(|i| row(i, &format!("k{}", i % 8))).collect();
        lanes.accept(1, rows);
        let busy = lanes.busy_partitions();
        assert!(busy.len() > 1);
        let keep: std::collections::BTreeSet<i32> = busy.iter().take(1).copied().collect();
        let out = lanes.take_ready(100, 1);
        let released = lanes.keep_only_partitions(&keep);
        // Every head went out; the rows queued behind heads of other partitions come back.
        assert!(!released.is_empty());
        for id in &released {
            let key = format!("k{}", id % 8);
            assert!(!keep.contains(&outbox_core::partition_of(&key, 4)));
        }
        lanes.forget(&released);
        lanes.forget(&seqs(&out));
        for head in seqs(&out) {
            let key = format!("k{}", head % 8);
            lanes.advance(&lanes.lane_of(0, &key));
        }
        assert_eq!(
            lanes.busy_partitions(),
            keep,
            "only the kept partition still has rows"
        );
    }

    /// Rows 1, 2, 3 of key `a`; head 1 failed and must retry. Its retry statement reported
    /// once claim 2 had started; claim 2, begun before that, ran once row 1 came due and
    /// returned it, so row 1 went back (a second release, still running); then the release
    /// of rows 2 and 3 reported. Claim 3 begins now, and reads the store while row 1 is
    /// still this node's: it skips row 1, which holds nothing back, and returns rows 2 and 3.
    fn row_1_released_while_claim_3_reads() -> (Lanes, LaneKey) {
        let mut lanes = Lanes::new(true, None);
        lanes.accept(1, vec![row(1, "a"), row(2, "a"), row(3, "a")]);
        assert_eq!(seqs(&lanes.take_ready(10, 1)), vec![1]);
        let a = lanes.lane_of(0, "a");
        let behind = lanes.block(&a);
        lanes.releasing(&behind);
        lanes.releasing(&[1]); // the retry statement releases the head too
        lanes.retry_recorded(&a, 2);
        lanes.forget_released(&[1], 2);
        let stale = lanes.accept(2, vec![row(1, "a")]);
        assert_eq!(stale, vec![1], "a stale claim's row goes back");
        lanes.releasing(&stale);
        lanes.expire_blocks(2);
        lanes.forget_released(&behind, 2);
        (lanes, a)
    }

    /// Race: claim 3 (begun after the retry was recorded, so no longer blocked) returns the
    /// rows behind row 1 while row 1's second release runs. They must go back, not overtake
    /// it (`faults::broker_link_delayed_while_database_link_cut`).
    #[test]
    fn race_rows_claimed_while_an_earlier_row_of_their_key_is_released_go_back_too() {
        let (mut lanes, a) = row_1_released_while_claim_3_reads();
        assert_eq!(
            lanes.accept(3, vec![row(2, "a"), row(3, "a")]),
            vec![2, 3],
            "rows behind a row being released go back"
        );
        lanes.releasing(&[2, 3]);
        lanes.expire_blocks(3);
        assert!(
            lanes.take_ready(10, 1).is_empty(),
            "nothing overtakes row 1"
        );
        // Row 1's release reports; the next claim takes it first, then the rest.
        lanes.forget_released(&[1], 3);
        assert!(lanes.accept(4, vec![row(1, "a")]).is_empty());
        lanes.expire_blocks(4);
        lanes.forget_released(&[2, 3], 5);
        assert!(lanes.accept(5, vec![row(2, "a"), row(3, "a")]).is_empty());
        assert_eq!(seqs(&lanes.take_ready(10, 1)), vec![1]);
        lanes.advance(&a);
        assert_eq!(seqs(&lanes.take_ready(10, 1)), vec![2]);
        lanes.advance(&a);
        assert_eq!(seqs(&lanes.take_ready(10, 1)), vec![3]);
        assert!(lanes.releasing.is_empty() && lanes.released_by_lane.is_empty());
    }

    /// Race: as above, but row 1's release reports before claim 3 does. Claim 3 read the
    /// store before that release committed, so its rows go back all the same.
    #[test]
    fn race_a_release_that_reports_while_a_claim_that_skipped_its_row_is_out() {
        let (mut lanes, _) = row_1_released_while_claim_3_reads();
        lanes.forget_released(&[1], 3); // claim 3 had started
        assert_eq!(
            lanes.accept(3, vec![row(2, "a"), row(3, "a")]),
            vec![2, 3],
            "a claim begun before the release reported may have skipped row 1"
        );
        lanes.releasing(&[2, 3]);
        lanes.expire_blocks(3);
        assert!(
            lanes.take_ready(10, 1).is_empty(),
            "nothing overtakes row 1"
        );
        // Claim 4 began after the report: it sees row 1, and returns it first.
        assert!(lanes.accept(4, vec![row(1, "a")]).is_empty());
        assert_eq!(seqs(&lanes.take_ready(10, 1)), vec![1]);
    }

    /// Race: a stale claim returns a retrying head after its retry committed, so the head
    /// goes back a second time; the retry then reports while that second release runs. The
    /// head stays this node's until the second release reports, and holds later rows of its
    /// key back until then.
    #[test]
    fn race_a_row_released_twice_is_held_until_both_releases_report() {
        let mut lanes = Lanes::new(true, None);
        lanes.accept(1, vec![row(1, "a"), row(2, "a")]);
        assert_eq!(seqs(&lanes.take_ready(10, 1)), vec![1]);
        let a = lanes.lane_of(0, "a");
        let behind = lanes.block(&a);
        lanes.releasing(&behind);
        lanes.releasing(&[1]); // the retry
        let again = lanes.accept(2, vec![row(1, "a")]);
        assert_eq!(again, vec![1], "the retry is not recorded yet");
        lanes.releasing(&again);
        lanes.retry_recorded(&a, 2);
        lanes.forget_released(&[1], 2);
        assert_eq!(lanes.held(), 2, "row 1's second release still runs");
        lanes.forget_released(&behind, 2);
        lanes.expire_blocks(2);
        assert_eq!(
            lanes.accept(3, vec![row(2, "a")]),
            vec![2],
            "row 2 waits for row 1's second release"
        );
        lanes.releasing(&[2]);
        lanes.forget_released(&[1], 3);
        lanes.forget_released(&[2], 3);
        assert_eq!(lanes.held(), 0);
    }

    #[test]
    fn a_row_claimed_again_while_its_release_is_reported_is_queued_not_lost() {
        let mut lanes = Lanes::new(true, None);
        lanes.accept(1, vec![row(1, "a"), row(2, "a")]);
        lanes.take_ready(10, 1);
        let behind = lanes.block(&lanes.lane_of(0, "a"));
        assert_eq!(behind, vec![2]);
        lanes.releasing(&[1]); // the head's retry statement releases it too
        lanes.releasing(&behind);
        lanes.retry_recorded(&lanes.lane_of(0, "a"), 1);
        lanes.expire_blocks(2);
        // Both statements committed; a claim takes row 1 (due again) and row 2 before
        // either reported back.
        assert!(lanes.accept(2, vec![row(1, "a"), row(2, "a")]).is_empty());
        lanes.forget_released(&[1], 2);
        lanes.forget_released(&behind, 2);
        assert_eq!(lanes.held(), 2, "row 2 is held again, not forgotten");
        assert_eq!(seqs(&lanes.take_ready(10, 1)), vec![1]);
        lanes.advance(&lanes.lane_of(0, "a"));
        assert_eq!(seqs(&lanes.take_ready(10, 1)), vec![2]);
    }
}

/// Random interleavings of the engine's calls against a model of the store: claims (one at
/// a time, numbered) that skip the node's own rows without being held back by them and stop
/// at a key whose row waits to retry, and ack, retry and release statements that commit and
/// report at separate moments; in some runs partitions are lost and taken again, or the
/// engine stops part-way. Every run must hand each row out only after every earlier row of
/// its key was published, and end with nothing held.
#[cfg(test)]
mod interleavings {
    use super::tests::{row, seqs};
    use super::*;
    use std::collections::{BTreeMap, HashSet};

    /// xorshift: reproducible from the seed the failure names.
    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % n
        }
    }

    struct StoredRow {
        key: String,
        gone: bool,
        held: bool,
        available_at: u64,
    }

    /// A statement: it commits in the store first, and reports to the lanes later.
    enum Statement {
        /// Runs of rows, one per lane.
        Publish(Vec<Vec<SequenceId>>),
        Ack {
            ids: Vec<SequenceId>,
            committed: bool,
        },
        Retry {
            keys: Vec<LaneKey>,
            ids: Vec<SequenceId>,
            delay: u64,
            committed: bool,
        },
        Release {
            ids: Vec<SequenceId>,
            committed: bool,
        },
    }

    /// The claim out: its number, its limit, and its rows once it read the store.
    struct Claim {
        no: u64,
        limit: usize,
        read: Option<Vec<SequenceId>>,
    }

    /// What a run varies besides the seed.
    #[derive(Clone, Copy, Debug)]
    struct Variant {
        ordered: bool,
        /// Two partitions, one of them now and then lost and taken again.
        churn: bool,
        /// The step at which the engine stops (releasing what it has not handed out).
        stop_at: Option<u64>,
    }

    fn run(seed: u64, variant: Variant) -> Result<(), String> {
        let Variant {
            ordered,
            churn,
            stop_at,
        } = variant;
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let keys = 1 + rng.below(3);
        let mut store: BTreeMap<SequenceId, StoredRow> = (1..=4 + rng.below(10) as i64)
            .map(|seq| {
                let key = format!("k{}", rng.below(keys));
                (
                    seq,
                    StoredRow {
                        key,
                        gone: false,
                        held: false,
                        available_at: 0,
                    },
                )
            })
            .collect();
        let key_of: BTreeMap<SequenceId, String> =
            store.iter().map(|(s, r)| (*s, r.key.clone())).collect();
        const PARTITIONS: u32 = 2;
        let partition = |seq: &SequenceId| outbox_core::partition_of(&key_of[seq], PARTITIONS);
        let mut lanes = Lanes::new(ordered, churn.then_some(PARTITIONS));
        let mut owned: std::collections::BTreeSet<i32> = (0..PARTITIONS as i32).collect();
        let mut stopping = false;
        let (mut now, mut claims_started) = (0u64, 0u64);
        let mut claim: Option<Claim> = None;
        let mut statements: Vec<Statement> = Vec::new();
        let mut published: HashSet<SequenceId> = HashSet::new();
        let mut out: HashSet<SequenceId> = HashSet::new();
        let mut log = Vec::new();
        let fail = |what: String, log: &[String]| {
            Err(format!(
                "seed {seed}, {variant:?}: {what}\n{}",
                log.join("\n")
            ))
        };
        for step in 0..100_000 {
            if rng.below(3) == 0 {
                now += 1;
            }
            let mut back = Vec::new();
            if stop_at == Some(step) {
                stopping = true;
                back = lanes.take_unstarted();
                log.push(format!("t{now} stop: release {back:?}"));
            } else if churn && !stopping && rng.below(40) == 0 {
                if owned.len() == PARTITIONS as usize {
                    owned.remove(&(rng.below(u64::from(PARTITIONS)) as i32));
                    back = lanes.keep_only_partitions(&owned);
                } else {
                    owned = (0..PARTITIONS as i32).collect();
                }
                log.push(format!("t{now} partitions {owned:?}, release {back:?}"));
            }
            if !back.is_empty() {
                lanes.releasing(&back);
                statements.push(Statement::Release {
                    ids: back,
                    committed: false,
                });
            }
            let heads: Vec<Vec<SequenceId>> = if stopping {
                Vec::new()
            } else {
                let max_rows = 1 + rng.below(6) as usize;
                let per_lane = 1 + rng.below(3) as usize;
                // A lane's run is consecutive in the handout.
                let mut runs: Vec<Vec<SequenceId>> = Vec::new();
                for seq in seqs(&lanes.take_ready(max_rows, per_lane)) {
                    let lane = lanes.lane_of(seq, &key_of[&seq]);
                    match runs.last_mut() {
                        Some(run) if lanes.lane_of(run[0], &key_of[&run[0]]) == lane => {
                            run.push(seq)
                        }
                        _ => runs.push(vec![seq]),
                    }
                }
                runs
            };
            for run in &heads {
                for (i, &seq) in run.iter().enumerate() {
                    // Rows ahead of it in its own run are published before it, or it fails.
                    let earlier_unpublished = key_of.range(..seq).find(|(s, k)| {
                        ordered
                            && **k == key_of[&seq]
                            && !published.contains(*s)
                            && !run[..i].contains(*s)
                    });
                    if let Some((earlier, _)) = earlier_unpublished {
                        return fail(format!("{seq} handed out before {earlier}"), &log);
                    }
                    if published.contains(&seq) || !out.insert(seq) {
                        return fail(format!("{seq} handed out again"), &log);
                    }
                }
            }
            if !heads.is_empty() {
                log.push(format!("t{now} publish {heads:?}"));
                statements.push(Statement::Publish(heads));
            }
            if claim.is_none() && !stopping && rng.below(2) == 0 {
                claims_started += 1;
                let limit = 1 + rng.below(5) as usize;
                claim = Some(Claim {
                    no: claims_started,
                    limit,
                    read: None,
                });
            }
            let choices = statements.len() + usize::from(claim.is_some());
            if choices == 0 {
                if stopping {
                    if lanes.held() > 0 || !lanes.releasing.is_empty() {
                        return fail("rows left held after the engine stopped".into(), &log);
                    }
                    return Ok(());
                }
                if !store.values().all(|r| r.gone) {
                    continue;
                }
                if lanes.held() > 0
                    || !lanes.releasing.is_empty()
                    || !lanes.released_by_lane.is_empty()
                {
                    return fail(
                        "rows left in the lanes after every row settled".into(),
                        &log,
                    );
                }
                return Ok(());
            }
            let pick = rng.below(choices as u64) as usize;
            if pick == statements.len() {
                let c = claim.as_mut().expect("a claim is out");
                match c.read.take() {
                    None => {
                        let mut rows = Vec::new();
                        let mut waiting_keys = HashSet::new();
                        for (seq, r) in store.iter_mut() {
                            let not_owned = !owned.contains(&partition(seq));
                            if r.gone || r.held || not_owned || waiting_keys.contains(&r.key) {
                                continue;
                            }
                            if r.available_at > now {
                                if ordered {
                                    waiting_keys.insert(r.key.clone());
                                }
                                continue;
                            }
                            if rows.len() == c.limit {
                                break;
                            }
                            r.held = true;
                            rows.push(*seq);
                        }
                        log.push(format!("t{now} claim {} reads {rows:?}", c.no));
                        c.read = Some(rows);
                    }
                    Some(rows) => {
                        let no = c.no;
                        claim = None;
                        let back =
                            lanes.accept(no, rows.iter().map(|s| row(*s, &key_of[s])).collect());
                        lanes.expire_blocks(no);
                        log.push(format!("t{now} claim {no} reports {rows:?}, back {back:?}"));
                        // Rows of partitions lost while it ran, and everything once stopping.
                        let mut back = back;
                        if stopping {
                            back.extend(lanes.take_unstarted());
                        } else if churn {
                            back.extend(lanes.keep_only_partitions(&owned));
                        }
                        if !back.is_empty() {
                            lanes.releasing(&back);
                            statements.push(Statement::Release {
                                ids: back,
                                committed: false,
                            });
                        }
                    }
                }
                continue;
            }
            match &mut statements[pick] {
                Statement::Publish(heads) => {
                    let heads = std::mem::take(heads);
                    statements.swap_remove(pick);
                    let (mut acked, mut keys, mut retried, mut behind) =
                        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
                    for run in heads {
                        let lane = lanes.lane_of(run[0], &key_of[&run[0]]);
                        // The sink stores a prefix of the run; the row after it failed.
                        let stored = run.iter().take_while(|_| rng.below(3) > 0).count();
                        for &seq in &run {
                            out.remove(&seq);
                        }
                        published.extend(&run[..stored]);
                        acked.extend(&run[..stored]);
                        lanes.confirmed(&lane, stored);
                        if let Some(&failed) = run.get(stored) {
                            behind.extend(lanes.block(&lane));
                            keys.push(lane);
                            retried.push(failed);
                        }
                    }
                    log.push(format!(
                        "t{now} confirmed {acked:?}, retry {retried:?}, release {behind:?}"
                    ));
                    if !acked.is_empty() {
                        statements.push(Statement::Ack {
                            ids: acked,
                            committed: false,
                        });
                    }
                    if !retried.is_empty() {
                        lanes.releasing(&retried);
                        let delay = rng.below(4);
                        statements.push(Statement::Retry {
                            keys,
                            ids: retried,
                            delay,
                            committed: false,
                        });
                    }
                    if !behind.is_empty() {
                        lanes.releasing(&behind);
                        statements.push(Statement::Release {
                            ids: behind,
                            committed: false,
                        });
                    }
                }
                Statement::Ack {
                    ids,
                    committed: committed @ false,
                } => {
                    for seq in ids.iter() {
                        store.get_mut(seq).expect("stored").gone = true;
                    }
                    *committed = true;
                }
                Statement::Ack { ids, .. } => {
                    let ids = std::mem::take(ids);
                    statements.swap_remove(pick);
                    lanes.forget(&ids);
                }
                Statement::Retry {
                    ids,
                    delay,
                    committed: committed @ false,
                    ..
                } => {
                    for seq in ids.iter() {
                        let r = store.get_mut(seq).expect("stored");
                        r.available_at = now + *delay;
                        r.held = false;
                    }
                    log.push(format!("t{now} retry of {ids:?} commits"));
                    *committed = true;
                }
                Statement::Retry { keys, ids, .. } => {
                    let (keys, ids) = (std::mem::take(keys), std::mem::take(ids));
                    statements.swap_remove(pick);
                    for key in &keys {
                        lanes.retry_recorded(key, claims_started);
                    }
                    log.push(format!(
                        "t{now} retry of {ids:?} reports after claim {claims_started}"
                    ));
                    lanes.forget_released(&ids, claims_started);
                }
                Statement::Release {
                    ids,
                    committed: committed @ false,
                } => {
                    for seq in ids.iter() {
                        store.get_mut(seq).expect("stored").held = false;
                    }
                    log.push(format!("t{now} release of {ids:?} commits"));
                    *committed = true;
                }
                Statement::Release { ids, .. } => {
                    let ids = std::mem::take(ids);
                    statements.swap_remove(pick);
                    log.push(format!(
                        "t{now} release of {ids:?} reports after claim {claims_started}"
                    ));
                    lanes.forget_released(&ids, claims_started);
                }
            }
        }
        fail("no end".into(), &log[log.len().saturating_sub(60)..])
    }

    #[test]
    fn random_interleavings_keep_each_keys_order_and_leave_nothing_held() {
        for seed in 0..5_000 {
            for (ordered, churn) in [(true, false), (false, false), (true, true)] {
                let stop_at = (seed % 4 == 0).then_some(seed % 64);
                let variant = Variant {
                    ordered,
                    churn,
                    stop_at,
                };
                run(seed, variant).unwrap();
            }
        }
    }
}
