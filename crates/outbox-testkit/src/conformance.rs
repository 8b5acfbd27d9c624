//! The store conformance suite. Each store's `tests/it/conformance.rs` implements [`Harness`]
//! and stamps every test out with [`store_conformance!`](crate::store_conformance), so all
//! stores are held to the contract in `outbox_core::store`: the claim/ack/retry/dead-letter
//! lifecycle and the engine over it (this file), 10 kB ordering keys (`long_keys.rs`),
//! rows and columns an operator got wrong (`bad_rows.rs`), and the operator commands over
//! dead letters and retained events (`operator.rs`).

mod bad_rows;
/// Claims everything and dead-letters the undecodable rows, as the engine does (for a
/// store's own bad-row cases beside the shared ones).
pub use bad_rows::claim_and_settle;
mod long_keys;
mod operator;

pub use bad_rows::{
    created_at_before_1970_is_delivered_and_beyond_9999_is_dead_lettered,
    verify_names_a_renamed_column, Expect, OddTime, RenamedColumn,
};
pub use long_keys::{
    a_10kb_key_is_claimed_retried_and_delivered_without_ordering,
    a_10kb_key_waiting_to_retry_holds_back_only_its_own_key_in_owned_partitions,
    a_10kb_key_waiting_to_retry_holds_back_only_its_own_key_under_row_leases, keyed_event,
    long_key, payloads, retry,
};
pub use operator::{
    operator_lists_retries_and_purges_dead_letters,
    operator_pages_dead_letters_and_shows_one_event, operator_replays_and_prunes_in_batches,
    operator_retry_leaves_a_dead_letter_whose_event_came_back,
};

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use outbox_core::store::{
    Backlog, ClaimRequest, Crowded, DeadLetter, DeadQuery, DeadRetried, DeadSelector, EventState,
    Heartbeat, Heartbeated, Incarnation, LeaseExtension, LeaseHolder, NodeRegistry, OnChange,
    Operations, PartitionRegistry, Problem, Registration, ReplayPage, ReplaySelector, RetryLater,
    StoreFuture,
};
use outbox_core::{
    Claimed, NewEvent, NodeId, OutboxStore, PublishErrorKind, RetryPolicy, SequenceId, StoreError,
    StoreErrorKind,
};
use outbox_engine::{DrainEnd, EngineConfig, Summary, WakeMode};

use crate::eventually;
use crate::recording::RecordingPublisher;

/// A dead-lettered row as the suite checks it.
#[derive(Clone, Debug, PartialEq)]
pub struct DeadRow {
    pub sequence_id: SequenceId,
    pub attempts: i64,
    pub last_error: String,
    /// The payload as JSON text.
    pub payload: Option<String>,
}

/// One fresh, migrated database per test.
pub trait Harness: Send + Sync {
    /// A store that deletes rows on ack.
    fn store(&self) -> Arc<dyn OutboxStore>;
    /// A store over the same database that keeps delivered rows.
    fn retaining_store(&self) -> Arc<dyn OutboxStore>;
    fn registry(&self) -> Arc<dyn NodeRegistry>;
    /// Operator commands over the same database.
    fn operations(&self) -> Arc<dyn Operations>;
    /// Inserts an event inside a transaction that is rolled back.
    fn insert_rolled_back(&self, destination: &str) -> BoxFuture<'_, ()>;
    /// Inserts a row whose headers are not a JSON object.
    fn insert_undecodable(&self, destination: &str) -> BoxFuture<'_, SequenceId>;
    /// `(attempts, last_error, delivered)` of an outbox row, `None` if it is gone.
    fn row_state(&self, id: SequenceId) -> BoxFuture<'_, Option<(i64, Option<String>, bool)>>;
    fn dead_rows(&self) -> BoxFuture<'_, Vec<DeadRow>>;

    /// The outbox table's name in SQL.
    fn table(&self) -> &str;
    /// Runs SQL on the database (rows and schema changes the store's API cannot make).
    fn execute<'a>(&'a self, sql: &'a str) -> BoxFuture<'a, ()>;
    /// Makes the database refuse to delete row `id` (`Some`), as an application's foreign
    /// key to it would, or lets every row go again (`None`).
    fn refuse_deleting(&self, id: Option<SequenceId>) -> BoxFuture<'_, ()>;
    /// The store's partition leases, for stores that have them (the `owned_partitions` cases).
    fn partitions(&self) -> Option<Arc<dyn PartitionRegistry>> {
        None
    }
    /// Rows with odd `created_at` values, in this database's SQL (the `created_at` case).
    fn odd_created_at(&self) -> Vec<OddTime> {
        panic!("a store that cannot hold an odd created_at marks created_at not applicable")
    }
    /// Holds row `id` locked from a transaction of another session, as an application's
    /// `SELECT … FOR UPDATE` does (`Some`), or ends that transaction (`None`) (the
    /// `row_locks` case).
    fn lock_row_elsewhere(&self, _id: Option<SequenceId>) -> BoxFuture<'_, ()> {
        panic!("a store without row locks marks row_locks not applicable")
    }
    /// What `verify` says of a renamed column (the `renamed_column` case).
    fn renamed_column(&self) -> RenamedColumn {
        panic!(
            "a store whose verify cannot see a renamed column marks renamed_column not applicable"
        )
    }
}

/// Stamps out one `#[tokio::test]` per conformance test, given an async harness constructor.
///
/// - `store_conformance!(new_harness)`: every test.
/// - `store_conformance!(new_harness; long_keys: M, owned_partitions: M, created_at: M,
///   renamed_column: M, row_locks: M)`: the lifecycle tests, and each group of cases run (`M` = `run`),
///   left out with the reason it does not apply to the store (`M` = `not_applicable("…")`), or
///   ignored for a bug of the store's, named (`M` = `known_bug("…")`: `--run-ignored` runs it).
/// - `store_conformance!(@groups new_harness; …)`: the groups alone, as above.
/// - `store_conformance!(@tests new_harness; names…)`: the tests named.
#[macro_export]
macro_rules! store_conformance {
    ($new_harness:path) => {
        $crate::store_conformance!($new_harness;
            long_keys: run, owned_partitions: run, created_at: run, renamed_column: run,
            row_locks: run);
    };
    ($new_harness:path; $($groups:tt)*) => {
        $crate::store_conformance!(@tests $new_harness;
            exclusive_claims, claims_leave_out_crowded_keys,
            per_key_order_across_nodes, retry_scheduling,
            dead_lettering_keeps_the_whole_event, lease_expiry,
            crash_between_publish_and_ack_redelivers, rolled_back_inserts_are_never_claimed,
            undecodable_rows_are_claimed_for_dead_lettering, ack_deletes_or_retains,
            release_makes_rows_claimable, release_unheld_frees_the_rows_the_node_does_not_hold,
            node_registry, engine_delivers_in_order_per_key, engine_retry_blocks_only_its_key,
            engine_a_row_the_database_refuses_to_delete_holds_back_no_other,
            engine_runs_of_a_key_keep_their_order_through_failures,
            engine_unordered_events_held_back_by_the_sink_go_out_again_unretried,
            engine_dead_letters_after_max_attempts_and_moves_on,
            engine_an_outage_spends_no_attempts,
            engine_one_event_refused_beside_one_failing_for_itself_is_no_outage,
            engine_dead_letters_permanent_errors_and_undecodable_rows,
            engine_a_dead_letter_the_fence_refuses_keeps_its_key_in_order,
            engine_unordered_retries_and_dead_letters_go_out_again,
            engine_drain_ends_when_every_claim_keeps_failing,
            engine_drain_leaves_a_failed_row_that_arrived_during_it_to_the_next_run,
            engine_holds_no_more_claimed_bytes_than_its_memory_budget,
            engine_shutdown_keeps_the_lease_of_an_event_still_publishing,
            engine_a_slow_key_leaves_room_for_the_others,
            engine_a_crowded_key_delays_no_claim_of_a_store_that_cannot_leave_it_out,
            engine_a_dead_letter_whose_answer_was_lost_is_not_vouched_for,
            engine_a_claim_whose_answer_was_lost_keeps_its_key_in_order,
            operator_lists_retries_and_purges_dead_letters, operator_replays_and_prunes_in_batches,
            operator_pages_dead_letters_and_shows_one_event);
        $crate::store_conformance!(@groups $new_harness; $($groups)*);
    };
    (@groups $new_harness:path;
        long_keys: $long_keys:ident $(($long_keys_reason:literal))?,
        owned_partitions: $owned:ident $(($owned_reason:literal))?,
        created_at: $created_at:ident $(($created_at_reason:literal))?,
        renamed_column: $renamed:ident $(($renamed_reason:literal))?,
        row_locks: $row_locks:ident $(($row_locks_reason:literal))? $(,)?
    ) => {
        $crate::store_conformance!(@group $new_harness; $long_keys $(($long_keys_reason))?;
            a_10kb_key_is_claimed_retried_and_delivered_without_ordering,
            a_10kb_key_waiting_to_retry_holds_back_only_its_own_key_under_row_leases);
        $crate::store_conformance!(@group $new_harness; $owned $(($owned_reason))?;
            a_10kb_key_waiting_to_retry_holds_back_only_its_own_key_in_owned_partitions);
        $crate::store_conformance!(@group $new_harness; $created_at $(($created_at_reason))?;
            created_at_before_1970_is_delivered_and_beyond_9999_is_dead_lettered);
        $crate::store_conformance!(@group $new_harness; $renamed $(($renamed_reason))?;
            verify_names_a_renamed_column);
        $crate::store_conformance!(@group $new_harness; $row_locks $(($row_locks_reason))?;
            a_row_another_transaction_holds_locked_holds_back_its_key_only);
    };
    (@group $new_harness:path; run; $($name:ident),*) => {
        $crate::store_conformance!(@tests $new_harness; $($name),*);
    };
    (@group $new_harness:path; not_applicable($reason:literal); $($name:ident),*) => {};
    (@group $new_harness:path; known_bug($reason:literal); $($name:ident),*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            #[ignore = $reason]
            async fn $name() {
                let harness = $new_harness().await;
                $crate::conformance::$name(&harness).await;
            }
        )*
    };
    (@tests $new_harness:path; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let harness = $new_harness().await;
                $crate::conformance::$name(&harness).await;
            }
        )*
    };
}

fn event(destination: &str, key: Option<&str>, event_type: &str, n: usize) -> NewEvent {
    NewEvent {
        destination: destination.into(),
        partition_key: key.map(String::from),
        event_type: event_type.into(),
        payload: Some(format!(r#"{{"n":{n}}}"#)),
        ..NewEvent::default()
    }
}

/// The harness's store holding `rows` (see [`insert`]), and their ids.
async fn store_with(
    h: &dyn Harness,
    rows: &[(&str, Option<&str>, &str, usize)],
) -> (Arc<dyn OutboxStore>, Vec<SequenceId>) {
    let store = h.store();
    let seq = insert(&*store, rows).await;
    (store, seq)
}

/// Inserts `event(destination, key, type, n)` for each tuple, in order; returns their ids.
async fn insert(
    store: &dyn OutboxStore,
    rows: &[(&str, Option<&str>, &str, usize)],
) -> Vec<SequenceId> {
    let events = rows
        .iter()
        .map(|(d, k, t, n)| event(d, *k, t, *n))
        .collect();
    store.insert(events).await.unwrap()
}

fn request(node: &NodeId, limit: usize) -> ClaimRequest {
    ClaimRequest::new(node.clone(), limit, Duration::from_secs(30))
}

fn ids(claimed: &[Claimed]) -> Vec<SequenceId> {
    claimed.iter().map(Claimed::sequence_id).collect()
}

/// Claims for `node` until something comes back (a backoff or a lease running out).
async fn claimed_eventually(store: &dyn OutboxStore, node: &NodeId, what: &str) -> Vec<Claimed> {
    eventually(what, Duration::from_secs(10), || async {
        let c = store.claim(request(node, 10)).await.unwrap();
        (!c.is_empty()).then_some(c)
    })
    .await
}

/// Dead letters for `ids`, each with `attempts` and the error `error` names it by.
fn dead_letters(
    ids: &[SequenceId],
    attempts: u32,
    error: impl Fn(SequenceId) -> String,
) -> Vec<DeadLetter> {
    ids.iter()
        .map(|&sequence_id| DeadLetter {
            sequence_id,
            attempts,
            error: error(sequence_id),
        })
        .collect()
}

/// Asserts that a payload (JSON text) is `{"n": n}`, as [`event`] wrote it.
fn assert_payload(payload: Option<&str>, n: usize) {
    let payload: serde_json::Value = serde_json::from_str(payload.expect("a payload")).unwrap();
    assert_eq!(payload, serde_json::json!({ "n": n }));
}

/// The ids the publisher delivered, in delivery order.
fn delivered_ids(publisher: &RecordingPublisher) -> Vec<SequenceId> {
    publisher
        .delivered()
        .iter()
        .map(|e| e.sequence_id)
        .collect()
}

/// How often the publisher was handed `id`.
fn attempts_of(publisher: &RecordingPublisher, id: SequenceId) -> usize {
    publisher.attempts().iter().filter(|s| **s == id).count()
}

/// A claim leaves out every row of the keys the request names as crowded, looking only
/// at the first `window` pending rows then (under row leases, and in owned partitions where
/// the store has them); the next claim without them takes those rows, in order.
pub async fn claims_leave_out_crowded_keys(h: &dyn Harness) {
    let rows = [
        ("d", Some("a"), "t", 0),
        ("d", Some("a"), "t", 1),
        ("d", Some("b"), "t", 2),
        ("d", Some("c"), "t", 3),
    ];
    let (store, seq) = store_with(h, &rows).await;
    let crowded = |keys: &[&str], window: usize| Crowded {
        keys: keys.iter().map(|k| k.to_string()).collect(),
        window,
    };
    let node = NodeId::random();
    let claim = |crowded: Crowded| ClaimRequest {
        crowded,
        ..request(&node, 10)
    };
    let got = store.claim(claim(crowded(&["a"], 3))).await.unwrap();
    assert_eq!(ids(&got), [seq[2]], "key a left out, c past the window");
    let got = store.claim(claim(crowded(&["a"], 100))).await.unwrap();
    assert_eq!(ids(&got), [seq[3]], "key a left out");
    let got = store.claim(claim(Crowded::default())).await.unwrap();
    assert_eq!(
        ids(&got),
        [seq[0], seq[1]],
        "a's rows once a is not crowded"
    );

    let Some(registry) = h.partitions() else {
        return;
    };
    let more = insert(
        &*store,
        &[("d", Some("e"), "t", 4), ("d", Some("f"), "t", 5)],
    )
    .await;
    let owner = NodeId::random();
    let count = registry.partition_count().await.unwrap();
    let all: Vec<i32> = (0..count as i32).collect();
    let epochs = registry
        .acquire(owner.clone(), all.clone(), Duration::from_secs(30))
        .await
        .unwrap();
    let fence = Arc::new(outbox_core::Fence {
        count,
        partitions: all,
        epochs: epochs.iter().map(|(_, e)| *e).collect(),
    });
    let owned = |crowded: Crowded| ClaimRequest {
        fence: Some(fence.clone()),
        crowded,
        ..request(&owner, 10)
    };
    // Owned claims lease nothing: the rows claimed above come again, but for the crowded.
    let got = store.claim(owned(crowded(&["e"], 5))).await.unwrap();
    assert_eq!(ids(&got), seq, "owned: key e left out, f past the window");
    let got = store.claim(owned(Crowded::default())).await.unwrap();
    assert_eq!(ids(&got), more, "owned: the rest, in order");

    // The window counts the owned partitions' rows only: rows of partitions another node
    // owns, however many come first, never push this node's rows past it.
    let partition = |key: &str| outbox_core::partition::partition_of(key, count);
    let others: HashSet<i32> = ["a", "b", "c", "e", "f"].map(partition).into();
    let key_in = |wanted: &dyn Fn(i32) -> bool, skip: &str| {
        (0..10_000)
            .map(|n| format!("k{n}"))
            .find(|k| k != skip && wanted(partition(k)))
            .expect("a key of the partition wanted")
    };
    let crowded_key = key_in(&|p| !others.contains(&p), "");
    let ours = partition(&crowded_key);
    let next_key = key_in(&|p| p == ours, &crowded_key);
    let foreign = key_in(&|p| p != ours, "");
    let mut rows = vec![("d", Some(crowded_key.as_str()), "t", 6)];
    rows.extend((7..10).map(|n| ("d", Some(foreign.as_str()), "t", n)));
    rows.push(("d", Some(next_key.as_str()), "t", 10));
    let added = insert(&*store, &rows).await;
    let epoch = epochs.iter().find(|(p, _)| *p == ours).unwrap().1;
    let one = Arc::new(outbox_core::Fence {
        count,
        partitions: vec![ours],
        epochs: vec![epoch],
    });
    let got = store
        .claim(ClaimRequest {
            fence: Some(one),
            crowded: crowded(&[&crowded_key], 2),
            ..request(&owner, 10)
        })
        .await
        .unwrap();
    assert_eq!(
        ids(&got),
        [added[4]],
        "owned: {crowded_key} left out, {next_key} inside a window of this node's partition"
    );
}

pub async fn exclusive_claims(h: &dyn Harness) {
    let store = h.store();
    let events = (0..100)
        .map(|n| event("d", Some(&format!("k{n}")), "t", n))
        .collect();
    let inserted = store.insert(events).await.unwrap();
    let (a, b) = (NodeId::random(), NodeId::random());
    let (ra, rb) = tokio::join!(store.claim(request(&a, 60)), store.claim(request(&b, 60)));
    let (ra, rb) = (ids(&ra.unwrap()), ids(&rb.unwrap()));
    let sa: HashSet<_> = ra.iter().collect();
    assert!(
        rb.iter().all(|id| !sa.contains(id)),
        "a row was claimed twice"
    );
    // SKIP LOCKED may pass over a row the other claim only examined (InnoDB can lock one row
    // past its LIMIT): such a row is not lost, the next claim takes it.
    let rc = ids(&store.claim(request(&NodeId::random(), 100)).await.unwrap());
    let mut all: Vec<_> = ra
        .iter()
        .chain(rb.iter())
        .chain(rc.iter())
        .copied()
        .collect();
    all.sort();
    assert_eq!(all, inserted, "every row claimed exactly once");
    let c = store.claim(request(&NodeId::random(), 100)).await.unwrap();
    assert!(c.is_empty(), "leased rows are not claimable: {:?}", ids(&c));
}

pub async fn per_key_order_across_nodes(h: &dyn Harness) {
    let (store, seq) = store_with(
        h,
        &[
            ("d", Some("a"), "t", 1),
            ("d", Some("b"), "t", 2),
            ("d", Some("a"), "t", 3),
            ("d", None, "t", 4),
        ],
    )
    .await;
    let (a, b) = (NodeId::random(), NodeId::random());
    let first = store.claim(request(&a, 1)).await.unwrap();
    assert_eq!(ids(&first), vec![seq[0]]);
    // Node b must not get a's later row of key "a" while a holds the earlier one.
    let second = store.claim(request(&b, 10)).await.unwrap();
    assert_eq!(
        ids(&second),
        vec![seq[1], seq[3]],
        "key a is held by node a"
    );
    assert_eq!(
        second[1].ordering_key(),
        "d",
        "a NULL key orders by destination"
    );
    // Node a's own lease does not block node a: it queues the row behind its head.
    let third = store.claim(request(&a, 10)).await.unwrap();
    assert_eq!(ids(&third), vec![seq[2]]);
}

pub async fn retry_scheduling(h: &dyn Harness) {
    let (store, seq) = store_with(
        h,
        &[
            ("d", Some("a"), "t", 1),
            ("d", Some("a"), "t", 2),
            ("d", Some("b"), "t", 3),
        ],
    )
    .await;
    let node = NodeId::random();
    let claimed = store.claim(request(&node, 1)).await.unwrap();
    assert_eq!(ids(&claimed), vec![seq[0]]);
    let retry = RetryLater {
        sequence_id: seq[0],
        attempts: 1,
        error: "unavailable: broker down".into(),
        delay: Duration::from_millis(400),
    };
    assert_eq!(
        store
            .retry_later(LeaseHolder::unfenced(node), vec![retry])
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        h.row_state(seq[0]).await,
        Some((1, Some("unavailable: broker down".into()), false))
    );
    // While a's head waits, its later row is blocked too; b flows.
    let other = NodeId::random();
    let now = store.claim(request(&other, 10)).await.unwrap();
    assert_eq!(
        ids(&now),
        vec![seq[2]],
        "only key b is claimable during a's backoff"
    );
    // After the delay, a's rows come back in order, attempts intact.
    let later = claimed_eventually(&*store, &other, "the retry to come due").await;
    assert_eq!(ids(&later), vec![seq[0], seq[1]]);
    match &later[0] {
        Claimed::Event(e) => assert_eq!(e.attempts, 1),
        other => panic!("expected an event, got {other:?}"),
    }
}

pub async fn dead_lettering_keeps_the_whole_event(h: &dyn Harness) {
    let (store, seq) = store_with(h, &[("d", Some("a"), "t", 1), ("d", Some("a"), "t", 2)]).await;
    let node = NodeId::random();
    store.claim(request(&node, 1)).await.unwrap();
    let dead = DeadLetter {
        sequence_id: seq[0],
        attempts: 3,
        error: "too_large: 2 MiB > 1 MiB".into(),
    };
    assert_eq!(
        store
            .dead_letter(LeaseHolder::unfenced(node), vec![dead])
            .await
            .unwrap(),
        1
    );
    assert_eq!(h.row_state(seq[0]).await, None, "moved out of the outbox");
    let rows = h.dead_rows().await;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].sequence_id, seq[0]);
    assert_eq!(rows[0].attempts, 3);
    assert_eq!(rows[0].last_error, "too_large: 2 MiB > 1 MiB");
    assert_payload(rows[0].payload.as_deref(), 1);
    // The key carries on.
    let next = store.claim(request(&NodeId::random(), 10)).await.unwrap();
    assert_eq!(ids(&next), vec![seq[1]]);
    assert_eq!(store.backlog().await.unwrap().dead, 1);
}

pub async fn lease_expiry(h: &dyn Harness) {
    let (store, seq) = store_with(h, &[("d", Some("a"), "t", 1)]).await;
    let crashed = NodeId::random();
    let short = ClaimRequest::new(crashed.clone(), 10, Duration::from_millis(300));
    assert_eq!(ids(&store.claim(short).await.unwrap()), seq);
    let survivor = NodeId::random();
    assert!(store
        .claim(request(&survivor, 10))
        .await
        .unwrap()
        .is_empty());
    let reclaimed = claimed_eventually(&*store, &survivor, "the lease to expire").await;
    assert_eq!(ids(&reclaimed), seq);
    // Extending keeps a live lease alive.
    assert_eq!(
        store
            .extend_leases(LeaseExtension {
                node: survivor.clone(),
                ids: seq.clone(),
                lease: Duration::from_secs(30)
            })
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        store
            .extend_leases(LeaseExtension {
                node: crashed,
                ids: seq,
                lease: Duration::from_secs(30)
            })
            .await
            .unwrap(),
        0,
        "a node cannot extend a lease it lost"
    );
}

pub async fn crash_between_publish_and_ack_redelivers(h: &dyn Harness) {
    let (store, seq) = store_with(h, &[("d", Some("a"), "t", 1)]).await;
    let first = NodeId::random();
    let lease = ClaimRequest::new(first.clone(), 10, Duration::from_millis(300));
    let published = store.claim(lease).await.unwrap();
    let Claimed::Event(published) = &published[0] else {
        panic!("expected an event")
    };
    // ... the sink confirmed, and the node died before its ack.
    let second = NodeId::random();
    let again = claimed_eventually(&*store, &second, "redelivery after the lease").await;
    let Claimed::Event(again) = &again[0] else {
        panic!("expected an event")
    };
    assert_eq!(
        again.event_id, published.event_id,
        "same id: consumers can de-duplicate"
    );
    // The first node's late ack is fenced; the second node's ack lands.
    assert_eq!(
        store
            .ack(LeaseHolder::unfenced(first), seq.clone())
            .await
            .unwrap(),
        0
    );
    assert_eq!(
        store
            .ack(LeaseHolder::unfenced(second), seq.clone())
            .await
            .unwrap(),
        1
    );
    assert_eq!(h.row_state(seq[0]).await, None);
}

pub async fn rolled_back_inserts_are_never_claimed(h: &dyn Harness) {
    let store = h.store();
    h.insert_rolled_back("d").await;
    let committed = store.insert(vec![event("d", None, "t", 1)]).await.unwrap();
    h.insert_rolled_back("d").await;
    let claimed = store.claim(request(&NodeId::random(), 100)).await.unwrap();
    assert_eq!(ids(&claimed), committed);
}

pub async fn undecodable_rows_are_claimed_for_dead_lettering(h: &dyn Harness) {
    let store = h.store();
    let bad = h.insert_undecodable("d").await;
    let good = store
        .insert(vec![event("d", Some("x"), "t", 1)])
        .await
        .unwrap();
    let node = NodeId::random();
    let claimed = store.claim(request(&node, 10)).await.unwrap();
    assert_eq!(ids(&claimed), vec![bad, good[0]]);
    match &claimed[0] {
        Claimed::Undecodable { reason, .. } => {
            assert!(
                reason.contains("headers"),
                "reason names the column: {reason}"
            )
        }
        other => panic!("expected an undecodable row, got {other:?}"),
    }
    let dead = DeadLetter {
        sequence_id: bad,
        attempts: 0,
        error: "undecodable row".into(),
    };
    assert_eq!(
        store
            .dead_letter(LeaseHolder::unfenced(node), vec![dead])
            .await
            .unwrap(),
        1
    );
    assert_eq!(h.dead_rows().await[0].sequence_id, bad);
}

pub async fn ack_deletes_or_retains(h: &dyn Harness) {
    let store = h.store();
    let retaining = h.retaining_store();
    let seq = insert(
        &*store,
        &[("d", Some("a"), "t", 1), ("d", Some("b"), "t", 2)],
    )
    .await;
    let node = NodeId::random();
    store.claim(request(&node, 10)).await.unwrap();
    assert_eq!(
        store
            .ack(LeaseHolder::unfenced(node.clone()), vec![seq[0]])
            .await
            .unwrap(),
        1
    );
    assert_eq!(h.row_state(seq[0]).await, None, "deleted by default");
    assert_eq!(
        retaining
            .ack(LeaseHolder::unfenced(node.clone()), vec![seq[1]])
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        h.row_state(seq[1]).await,
        Some((0, None, true)),
        "kept, marked delivered"
    );
    assert!(store.claim(request(&node, 10)).await.unwrap().is_empty());
    assert_eq!(store.backlog().await.unwrap().pending, 0);
}

pub async fn release_makes_rows_claimable(h: &dyn Harness) {
    let (store, seq) = store_with(h, &[("d", Some("a"), "t", 1), ("d", Some("a"), "t", 2)]).await;
    let node = NodeId::random();
    store.claim(request(&node, 10)).await.unwrap();
    assert_eq!(store.release(node, seq.clone()).await.unwrap(), 2);
    let other = store.claim(request(&NodeId::random(), 10)).await.unwrap();
    assert_eq!(
        ids(&other),
        seq,
        "released rows come back at once, in order"
    );
    match &other[0] {
        Claimed::Event(e) => assert_eq!(e.attempts, 0, "a release is not an attempt"),
        other => panic!("expected an event, got {other:?}"),
    }
}

/// The leases of a claim whose answer was lost go back; the node's other leases, and other
/// nodes', stay.
pub async fn release_unheld_frees_the_rows_the_node_does_not_hold(h: &dyn Harness) {
    let rows: Vec<_> = ["k1", "k2", "k3", "k4", "k5"]
        .iter()
        .enumerate()
        .map(|(n, key)| ("d", Some(*key), "t", n))
        .collect();
    let (store, seq) = store_with(h, &rows).await;
    let (node, other) = (NodeId::random(), NodeId::random());
    let held = ids(&store.claim(request(&node, 2)).await.unwrap());
    assert_eq!(held, seq[..2]);
    let answer_lost = ids(&store.claim(request(&node, 2)).await.unwrap());
    assert_eq!(answer_lost, seq[2..4]);
    let others = ids(&store.claim(request(&other, 1)).await.unwrap());
    assert_eq!(others, seq[4..]);
    assert_eq!(
        store
            .release_unheld(node.clone(), held.clone())
            .await
            .unwrap(),
        2,
        "the rows of the claim whose answer was lost"
    );
    let again = store.claim(request(&node, 10)).await.unwrap();
    assert_eq!(ids(&again), answer_lost, "released rows come back at once");
    match &again[0] {
        Claimed::Event(e) => assert_eq!(e.attempts, 0, "a release is not an attempt"),
        other => panic!("expected an event, got {other:?}"),
    }
    assert_eq!(
        store.ack(LeaseHolder::unfenced(node), held).await.unwrap(),
        2,
        "the rows the node holds keep their lease"
    );
    assert_eq!(
        store
            .ack(LeaseHolder::unfenced(other), others)
            .await
            .unwrap(),
        1,
        "another node's lease is untouched"
    );
}

pub async fn node_registry(h: &dyn Harness) {
    let registry = h.registry();
    let (a, b) = (NodeId::random(), NodeId::random());
    let long = Duration::from_secs(30);
    let a1 = registered(&*registry, &a, long).await;
    let b1 = registered(&*registry, &b, Duration::from_millis(200)).await;
    // A second process with a's id finds the row live, with the expiry a wrote.
    assert_eq!(
        registry.register(a.clone(), long).await.unwrap(),
        Registration::Taken(a1)
    );
    // A longer ttl, so the new expiry differs from the first even at a coarse clock.
    let a2 = registry
        .heartbeat(Heartbeat {
            node: a.clone(),
            last: a1,
            ttl: Duration::from_secs(60),
        })
        .await
        .unwrap()
        .pushed()
        .expect("a's own heartbeat lands");
    assert_ne!(a1, a2);
    // A heartbeat conditioned on an expiry the row no longer shows is refused, and told the
    // expiry the row shows (the caller's to tell another process from a rolled-back row).
    assert_eq!(
        registry
            .heartbeat(Heartbeat {
                node: a.clone(),
                last: a1,
                ttl: long
            })
            .await
            .unwrap(),
        Heartbeated::RowShows(Some(a2))
    );
    assert_eq!(
        live_ids(&*registry).await,
        HashSet::from([a.0.clone(), b.0.clone()])
    );
    let removed = eventually("node b to expire", Duration::from_secs(10), || async {
        let n = registry.remove_expired().await.unwrap();
        (n > 0).then_some(n)
    })
    .await;
    assert_eq!(removed, 1);
    // b's row expired and was removed: its late heartbeat registers it again.
    assert!(registry
        .heartbeat(Heartbeat {
            node: b.clone(),
            last: b1,
            ttl: long
        })
        .await
        .unwrap()
        .pushed()
        .is_some());
    // An expired row is taken over by a restarted process at once.
    let c = NodeId::random();
    registered(&*registry, &c, Duration::from_millis(1)).await;
    eventually(
        "node c's row to be taken over",
        Duration::from_secs(10),
        || {
            let registry = registry.clone();
            let c = c.clone();
            async move {
                match registry.register(c, long).await.unwrap() {
                    Registration::Registered(i) => Some(i),
                    Registration::Taken(_) => None,
                }
            }
        },
    )
    .await;
    // Deregistering with a stale expiry leaves the row to whoever wrote it.
    registry.deregister(a.clone(), a1).await.unwrap();
    assert_eq!(registry.live_nodes().await.unwrap().len(), 3);
    registry.deregister(a, a2).await.unwrap();
    registry.deregister(b, b1).await.unwrap();
    let left = live_ids(&*registry).await;
    assert_eq!(
        left.len(),
        2,
        "b's stale deregister left its new row: {left:?}"
    );
}

/// Registers `node`, whose id no live row holds.
async fn registered(registry: &dyn NodeRegistry, node: &NodeId, ttl: Duration) -> Incarnation {
    match registry.register(node.clone(), ttl).await.unwrap() {
        Registration::Registered(incarnation) => incarnation,
        Registration::Taken(_) => panic!("a fresh id registers"),
    }
}

/// The ids of the live nodes.
async fn live_ids(registry: &dyn NodeRegistry) -> HashSet<String> {
    let live = registry.live_nodes().await.unwrap();
    live.into_iter().map(|n| n.id).collect()
}

/// Runs the engine with `engine_config(true)` until it has drained the outbox.
async fn drained(store: Arc<dyn OutboxStore>, publisher: &RecordingPublisher) -> Summary {
    let publisher = Arc::new(publisher.clone());
    outbox_engine::run(
        store,
        publisher,
        engine_config(true),
        std::future::pending(),
    )
    .await
    .unwrap()
}

fn engine_config(drain: bool) -> EngineConfig {
    let mut config = EngineConfig::new(NodeId::random());
    config.drain = drain;
    config.settings.batch_size = 7; // small, so ordering crosses claim boundaries
    config.wake = WakeMode::FixedRate;
    config.settings.poll_interval = Duration::from_millis(20);
    config.settings.retry = RetryPolicy {
        base_delay: Duration::from_millis(20),
        max_delay: Duration::from_millis(100),
        max_attempts: 3,
        max_attempts_by_type: HashMap::from([("fragile".to_string(), 1)]),
    };
    config
}

/// The engine running on a task of its own, and the switch that stops it.
fn spawn_engine(
    store: Arc<dyn OutboxStore>,
    publisher: &RecordingPublisher,
    config: EngineConfig,
) -> (
    tokio::task::JoinHandle<Result<Summary, outbox_core::StoreError>>,
    tokio::sync::oneshot::Sender<()>,
) {
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let engine = tokio::spawn(outbox_engine::run(
        store,
        Arc::new(publisher.clone()),
        config,
        async move {
            let _ = stop_rx.await;
        },
    ));
    (engine, stop_tx)
}

/// Runs the engine until every row is settled (delivered or dead), then stops it. If that
/// does not happen, the panic shows each remaining row and whether the engine still runs.
async fn run_until_settled(
    h: &dyn Harness,
    publisher: &RecordingPublisher,
    config: EngineConfig,
    rows: &[SequenceId],
) -> outbox_engine::Summary {
    run_until_settled_on(h, h.store(), publisher, config, rows).await
}

/// [`run_until_settled`] on `store` (the harness's, or one wrapping it).
async fn run_until_settled_on(
    h: &dyn Harness,
    store: Arc<dyn OutboxStore>,
    publisher: &RecordingPublisher,
    config: EngineConfig,
    rows: &[SequenceId],
) -> outbox_engine::Summary {
    let (engine, stop_tx) = spawn_engine(store.clone(), publisher, config);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        if store.backlog().await.unwrap().pending == 0 {
            break;
        }
        if tokio::time::Instant::now() >= deadline || engine.is_finished() {
            let mut states = Vec::new();
            for id in rows {
                states.push((*id, h.row_state(*id).await));
            }
            let finished = engine.is_finished();
            let result = if finished {
                format!("{:?}", engine.await)
            } else {
                "still running".into()
            };
            panic!(
                "the outbox did not empty: engine {result}; rows (id, (attempts, last_error, delivered)): {states:?}; attempts seen: {:?}",
                publisher.attempts()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop_tx.send(()).unwrap();
    engine.await.unwrap().unwrap()
}

fn assert_per_key_order(delivered: &[Arc<outbox_core::Event>]) {
    let mut last: HashMap<String, SequenceId> = HashMap::new();
    for e in delivered {
        if let Some(prev) = last.insert(e.ordering_key().to_string(), e.sequence_id) {
            assert!(
                prev < e.sequence_id,
                "key {} went {} then {}",
                e.ordering_key(),
                prev,
                e.sequence_id
            );
        }
    }
}

pub async fn engine_delivers_in_order_per_key(h: &dyn Harness) {
    let store = h.store();
    let events = (0..200)
        .map(|n| event("d", Some(&format!("k{}", n % 9)), "t", n))
        .collect();
    let seq = store.insert(events).await.unwrap();
    let publisher = RecordingPublisher::new();
    let summary = drained(store, &publisher).await;
    assert_eq!(summary.published, 200);
    let delivered = publisher.delivered();
    let mut got = delivered_ids(&publisher);
    got.sort();
    assert_eq!(got, seq);
    assert_per_key_order(&delivered);
    for batch in publisher.batches() {
        let keys: HashSet<_> = batch.iter().collect();
        assert_eq!(
            keys.len(),
            batch.len(),
            "a batch carried one key twice: {batch:?}"
        );
    }
}

/// A store behind `proxy`, its operation bound short: a claim once the network drops
/// everything (and tells nobody, so the pooled connection looks open) ends with a retryable
/// connection error, and the store answers again once the network is back.
pub async fn a_claim_through_a_blackhole_fails_retryably(
    store: &dyn OutboxStore,
    proxy: &crate::FaultProxy,
) {
    store.ping().await.unwrap();
    proxy.blackhole();
    let claim = store.claim(ClaimRequest::new(
        NodeId::random(),
        10,
        Duration::from_secs(30),
    ));
    // Only a guard against hanging forever (what happened before the operation bound).
    let outcome = tokio::time::timeout(Duration::from_secs(60), claim)
        .await
        .expect("a claim on a dead connection must end");
    let error = outcome.expect_err("nothing can be claimed through a blackhole");
    assert_eq!(
        error.kind(),
        StoreErrorKind::Connection,
        "{}",
        error.report()
    );
    assert!(error.is_retryable());
    proxy.heal();
    eventually(
        "the store to answer again",
        Duration::from_secs(60),
        || async { store.ping().await.ok() },
    )
    .await;
}

/// A publisher whose publishes end one event at a time, when the test lets them: how many
/// events it holds unconfirmed at most shows how much the engine claimed ahead of the sink.
#[derive(Clone)]
struct GatedPublisher(Arc<Gate>);

struct Gate {
    open: tokio::sync::Semaphore,
    waiting: std::sync::atomic::AtomicUsize,
    most_waiting: std::sync::atomic::AtomicUsize,
    done: std::sync::atomic::AtomicUsize,
}

impl GatedPublisher {
    fn new() -> Self {
        GatedPublisher(Arc::new(Gate {
            open: tokio::sync::Semaphore::new(0),
            waiting: 0.into(),
            most_waiting: 0.into(),
            done: 0.into(),
        }))
    }
}

impl outbox_core::Publisher for GatedPublisher {
    fn describe(&self) -> String {
        "gated".into()
    }

    fn publish(
        &self,
        batch: Vec<Arc<outbox_core::Event>>,
    ) -> BoxFuture<'static, Vec<outbox_core::Outcome>> {
        use std::sync::atomic::Ordering::SeqCst;
        let gate = self.0.clone();
        Box::pin(async move {
            let mut outcomes = Vec::with_capacity(batch.len());
            for _ in &batch {
                let now = gate.waiting.fetch_add(1, SeqCst) + 1;
                gate.most_waiting.fetch_max(now, SeqCst);
            }
            for _ in &batch {
                gate.open.acquire().await.expect("open").forget();
                gate.waiting.fetch_sub(1, SeqCst);
                gate.done.fetch_add(1, SeqCst);
                outcomes.push(Ok(()));
            }
            outcomes
        })
    }

    fn health(&self) -> BoxFuture<'static, Result<(), outbox_core::PublishError>> {
        Box::pin(async { Ok(()) })
    }
}

/// Claims were sized by row count alone: behind a slow sink a node held `max_in_flight`
/// events whatever their size (10,000 events of 1 MiB, an OOM kill that claimed them
/// again). With `memory_mib = 1`, events of 256 KiB are held three at a time, however many
/// a batch or `max_in_flight` would allow. And the first claim, before any row was seen,
/// took rows as if each were 1 MiB: with `memory_mib = 4`, six events of 2 MiB were all
/// held at once (a backlog of large events at start-up, claimed again after each OOM kill);
/// now one, then what fits.
pub async fn engine_holds_no_more_claimed_bytes_than_its_memory_budget(h: &dyn Harness) {
    held_under_a_budget(h, 1, 256 * 1024, 12, 3).await;
    held_under_a_budget(h, 4, 2 * 1024 * 1024, 6, 2).await;
}

/// `count` events of `payload_bytes` each relayed behind a gated sink under a budget of
/// `memory_mib`: no more than `most` wait at the sink at once.
async fn held_under_a_budget(
    h: &dyn Harness,
    memory_mib: u64,
    payload_bytes: usize,
    count: usize,
    most: usize,
) {
    use std::sync::atomic::Ordering::SeqCst;
    let store = h.store();
    let payload = format!("\"{}\"", "x".repeat(payload_bytes));
    let events: Vec<NewEvent> = (0..count)
        .map(|n| NewEvent {
            destination: "d".into(),
            partition_key: Some(format!("k{n}")),
            event_type: "t".into(),
            payload: Some(payload.clone()),
            ..NewEvent::default()
        })
        .collect();
    store.insert(events).await.unwrap();
    let publisher = GatedPublisher::new();
    let gate = publisher.0.clone();
    let mut config = engine_config(false);
    config.settings.memory_mib = memory_mib;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let engine = tokio::spawn(outbox_engine::run(
        store.clone(),
        Arc::new(publisher),
        config,
        async move {
            let _ = stop_rx.await;
        },
    ));
    for delivered in 1..=count {
        eventually(
            "an event waiting at the sink",
            Duration::from_secs(20),
            || {
                let waiting = gate.waiting.load(SeqCst);
                async move { (waiting > 0).then_some(()) }
            },
        )
        .await;
        gate.open.add_permits(1);
        eventually("the event confirmed", Duration::from_secs(20), || {
            let done = gate.done.load(SeqCst);
            async move { (done >= delivered).then_some(()) }
        })
        .await;
    }
    stop_tx.send(()).unwrap();
    engine.await.unwrap().unwrap();
    let held = gate.most_waiting.load(SeqCst);
    assert!(
        held <= most,
        "{held} events of {payload_bytes} bytes held at once under a budget of {memory_mib} MiB"
    );
}

/// A publisher that stores a prefix of each batch ([`outbox_core::Publisher::max_events_per_key`]) gets
/// runs of a key; a failure inside a run, retried or dead-lettered, leaves the key's order
/// and the rest of its run to go out again after it.
pub async fn engine_runs_of_a_key_keep_their_order_through_failures(h: &dyn Harness) {
    let rows: Vec<(&str, Option<&str>, &str, usize)> = (0..60)
        .map(|n| {
            let event_type = match n {
                9 => "flaky", // key a, inside a run
                13 => "huge", // key b, inside a run
                _ => "t",
            };
            ("d", Some(["a", "b", "c"][n % 3]), event_type, n)
        })
        .collect();
    let (_, seq) = store_with(h, &rows).await;
    let publisher = RecordingPublisher::storing_a_prefix();
    publisher.fail("flaky", 2, PublishErrorKind::Unavailable);
    publisher.fail("huge", 1, PublishErrorKind::TooLarge);
    let summary = run_until_settled(h, &publisher, engine_config(false), &seq).await;
    assert_eq!(summary.retried, 2);
    assert_eq!(summary.dead_lettered, 1);
    let dead: Vec<_> = h.dead_rows().await.iter().map(|d| d.sequence_id).collect();
    assert_eq!(dead, vec![seq[13]]);
    let mut got = delivered_ids(&publisher);
    got.sort();
    let expected: Vec<_> = seq.iter().copied().filter(|s| *s != seq[13]).collect();
    assert_eq!(
        got, expected,
        "each event delivered once, the dead one never"
    );
    assert_per_key_order(&publisher.delivered());
    assert!(
        publisher.held_back() > 0,
        "no failure fell inside a run (with later events of its key behind it in its batch): \
         the test did not exercise a run cut short"
    );
    assert!(
        publisher.batches().iter().any(|batch| {
            let keys: HashSet<_> = batch.iter().collect();
            keys.len() < batch.len()
        }),
        "no batch carried a run of a key: {:?}",
        publisher.batches()
    );
}

/// Under `--ordering none`, events that a run-keeping sink held back behind another lane's
/// failure of their key ([`PublishErrorKind::NotSent`]) go out again, no attempt counted:
/// with one attempt allowed, a count would dead-letter them.
pub async fn engine_unordered_events_held_back_by_the_sink_go_out_again_unretried(h: &dyn Harness) {
    let mut rows = vec![("d", Some("a"), "huge", 0)];
    rows.extend((1..6).map(|n| ("d", Some("a"), "t", n)));
    let (_, seq) = store_with(h, &rows).await;
    let publisher = RecordingPublisher::storing_a_prefix();
    publisher.fail("huge", 1, PublishErrorKind::TooLarge);
    let mut config = engine_config(false);
    config.ordered = false;
    config
        .settings
        .retry
        .max_attempts_by_type
        .insert("t".into(), 1);
    let summary = run_until_settled(h, &publisher, config, &seq).await;
    assert_eq!(summary.dead_lettered, 1, "only the event too large");
    assert_eq!(summary.retried, 0, "an event held back was not attempted");
    let mut got = delivered_ids(&publisher);
    got.sort();
    assert_eq!(got, seq[1..].to_vec());
}

pub async fn engine_retry_blocks_only_its_key(h: &dyn Harness) {
    let store = h.store();
    let mut events = vec![event("d", Some("slow"), "flaky", 0)];
    events.extend(
        (1..30).map(|n| event("d", Some(if n % 2 == 0 { "slow" } else { "fast" }), "t", n)),
    );
    let seq = store.insert(events).await.unwrap();
    let publisher = RecordingPublisher::new();
    publisher.fail("flaky", 2, PublishErrorKind::Unavailable);
    // The slow key's two retries take at least 100 + 200 ms: ample time for the fast key's
    // fifteen events, however loaded the machine.
    let mut config = engine_config(false);
    config.settings.retry.base_delay = Duration::from_millis(200);
    config.settings.retry.max_delay = Duration::from_millis(400);
    let summary = run_until_settled(h, &publisher, config, &seq).await;
    assert_eq!(summary.published, 30);
    assert_eq!(summary.retried, 2);
    let delivered = publisher.delivered();
    assert_per_key_order(&delivered);
    // "fast" was not held back by "slow"'s retries: it finished before slow's head got through.
    let head_at = delivered
        .iter()
        .position(|e| e.sequence_id == seq[0])
        .unwrap();
    let fast_done = delivered
        .iter()
        .rposition(|e| e.ordering_key() == "fast")
        .unwrap();
    assert!(
        fast_done < head_at,
        "fast key waited for the slow key's retries"
    );
    assert_eq!(attempts_of(&publisher, seq[0]), 3);
}

/// A row an application holds locked (`SELECT … FOR UPDATE` in its own transaction): the
/// claim's SKIP LOCKED passed over it and took the later rows of its key, which went out
/// before it. Its key now waits from that row on; the other keys are claimed.
pub async fn a_row_another_transaction_holds_locked_holds_back_its_key_only(h: &dyn Harness) {
    let store = h.store();
    let rows = [
        ("d", Some("a"), "t", 0),
        ("d", Some("b"), "t", 1),
        ("d", Some("a"), "t", 2),
        ("d", Some("b"), "t", 3),
        ("d", Some("a"), "t", 4),
    ];
    let ids = insert(&*store, &rows).await;
    let claimed_keys = || async {
        let request = ClaimRequest::new(NodeId::random(), 10, Duration::from_secs(30));
        let claimed = store.claim(request).await.unwrap();
        claimed
            .iter()
            .map(|c| c.ordering_key().to_string())
            .collect::<Vec<_>>()
    };
    h.lock_row_elsewhere(Some(ids[0])).await;
    assert_eq!(claimed_keys().await, ["b", "b"], "a's later rows wait");
    h.lock_row_elsewhere(None).await;
    assert_eq!(claimed_keys().await, ["a", "a", "a"]);
}

/// A row the database refuses to delete (an application's table keeps a foreign key to
/// it): the ack of its batch failed whole and was retried whole, so the batch's other rows,
/// of every key, stayed in the table (published again at the next start). The ack is now
/// split down to the one row, which alone waits, and goes once the refusal ends.
pub async fn engine_a_row_the_database_refuses_to_delete_holds_back_no_other(h: &dyn Harness) {
    let store = h.store();
    let keys = ["a", "b", "c", "d"];
    let events = (0..20)
        .map(|n| event("d", Some(keys[n % 4]), "t", n))
        .collect();
    let seq = store.insert(events).await.unwrap();
    let refused = seq[9];
    h.refuse_deleting(Some(refused)).await;
    let publisher = RecordingPublisher::new();
    let (engine, stop_tx) = spawn_engine(store.clone(), &publisher, engine_config(false));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    for &id in seq.iter().filter(|&&id| id != refused) {
        while h.row_state(id).await.is_some() {
            assert!(
                tokio::time::Instant::now() < deadline && !engine.is_finished(),
                "row {id} is still in the table beside the refused row {refused}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    assert!(h.row_state(refused).await.is_some());
    h.refuse_deleting(None).await;
    while h.row_state(refused).await.is_some() {
        assert!(
            tokio::time::Instant::now() < deadline && !engine.is_finished(),
            "the refused row {refused} stayed once let go"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop_tx.send(()).unwrap();
    let summary = engine.await.unwrap().unwrap();
    assert_eq!(summary.published, 20);
    let delivered = publisher.delivered();
    assert_eq!(delivered.len(), 20, "each event published once");
    assert_per_key_order(&delivered);
}

/// A shutdown whose deadline passes while an event is still with the sink (a broker that
/// has not answered, a producer that flushes as it closes) keeps that event's lease: it
/// released it, and another node sent it again while the first copy could still land,
/// after the key's next event (a1', a2, a1).
pub async fn engine_shutdown_keeps_the_lease_of_an_event_still_publishing(h: &dyn Harness) {
    let (store, publisher) = a_row_held_by_the_sink(h).await;
    let mut config = engine_config(false);
    config.settings.shutdown_timeout = Duration::from_millis(500);
    let (engine, stop_tx) = spawn_engine(store.clone(), &publisher, config);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while publisher.holding() == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the event never reached the sink"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop_tx.send(()).unwrap();
    let _ = engine.await.unwrap();
    let claimed = store
        .claim(ClaimRequest::new(
            NodeId::random(),
            10,
            Duration::from_secs(30),
        ))
        .await
        .unwrap();
    assert!(
        claimed.is_empty(),
        "another node claimed the event still with the sink: {claimed:?}"
    );
    publisher.release("held");
}

/// A key whose receiver does not answer (its events held at the sink) fills no more of
/// the node than its share: the other keys are claimed and delivered meanwhile. The node
/// used to fill `max_in_flight` with the slow key's backlog and claim nothing else until
/// it answered.
pub async fn engine_a_slow_key_leaves_room_for_the_others(h: &dyn Harness) {
    let mut rows: Vec<(String, String, &str)> = Vec::new();
    // No partition key: the destination is the key, as for a slow webhook receiver.
    rows.extend((0..30).map(|_| ("slow".to_string(), String::new(), "held")));
    rows.extend((0..6).map(|_| ("d".to_string(), "b".to_string(), "t")));
    rows.extend((0..6).map(|n| ("other".to_string(), format!("o{n}"), "t")));
    let rows: Vec<(&str, Option<&str>, &str, usize)> = rows
        .iter()
        .enumerate()
        .map(|(n, (d, k, t))| (d.as_str(), (!k.is_empty()).then_some(k.as_str()), *t, n))
        .collect();
    let (store, seq) = store_with(h, &rows).await;
    let publisher = RecordingPublisher::new();
    publisher.hold("held");
    let mut config = engine_config(false);
    config.settings.batch_size = 2;
    config.settings.max_in_flight = 16;
    // Past the test's patience: a publish timing out would free the node as well.
    config.settings.lease = Duration::from_secs(300);
    config.settings.publish_timeout = Duration::from_secs(280);
    let (engine, stop_tx) = spawn_engine(store, &publisher, config);
    let fast: Vec<SequenceId> = seq[30..].to_vec();
    eventually(
        "the other keys' events delivered while the slow ones wait",
        Duration::from_secs(30),
        || {
            let mut got = delivered_ids(&publisher);
            got.sort();
            let fast = fast.clone();
            async move { (got == fast).then_some(()) }
        },
    )
    .await;
    publisher.release("held");
    eventually("every event delivered", Duration::from_secs(30), || {
        let n = publisher.delivered().len();
        async move { (n == 42).then_some(()) }
    })
    .await;
    stop_tx.send(()).unwrap();
    engine.await.unwrap().unwrap();
    let slow: Vec<SequenceId> = publisher
        .delivered()
        .iter()
        .filter(|e| e.ordering_key() == "slow")
        .map(|e| e.sequence_id)
        .collect();
    assert_eq!(slow, seq[..30], "the slow key in order");
}

/// `--ordering none`: a retried event comes back to the same node (the only one here) and
/// must go out again; a dead-lettered one must not stay behind in memory.
pub async fn engine_unordered_retries_and_dead_letters_go_out_again(h: &dyn Harness) {
    let store = h.store();
    let mut events = vec![
        event("d", Some("a"), "flaky", 0),
        event("d", Some("a"), "doomed", 1),
    ];
    events.extend((2..20).map(|n| event("d", Some("a"), "t", n)));
    let seq = store.insert(events).await.unwrap();
    let publisher = RecordingPublisher::new();
    publisher.fail("flaky", 2, PublishErrorKind::Unavailable);
    // The event's own failure: the sink's condition (unavailable) spends no attempt while
    // the sink confirms nothing else, and doomed was left alone to retry.
    publisher.fail("doomed", 100, PublishErrorKind::BrokerFailure);
    let mut config = engine_config(false);
    config.ordered = false;
    let summary = run_until_settled(h, &publisher, config, &seq).await;
    assert_eq!(summary.published, 19);
    assert_eq!(
        summary.retried,
        2 + 2,
        "flaky twice, doomed until its third attempt"
    );
    assert_eq!(summary.dead_lettered, 1);
    assert_eq!(attempts_of(&publisher, seq[0]), 3);
}

/// A drain whose claims all fail (the database went away after the drain began) ends after
/// its patience, saying it cannot tell what is left, where it used to wait for a claim to
/// succeed without end. Nothing is acked. Claims that fail for less than the patience are
/// ridden out.
pub async fn engine_drain_ends_when_every_claim_keeps_failing(h: &dyn Harness) {
    let (store, _) = store_with(h, &[("d", Some("a"), "t", 0)]).await;
    let mut config = engine_config(true);
    config.drain_patience = Duration::from_millis(300);
    let summary = drain_through(FaultyStore::new(store.clone(), usize::MAX), config).await;
    match summary.drain {
        Some(DrainEnd::Unknown(e)) => assert!(
            e.contains("every claim failed") && e.contains(FaultyStore::ERROR),
            "{e}"
        ),
        other => panic!("the drain must end unable to vouch for the outbox: {other:?}"),
    }
    assert_eq!(
        store.backlog().await.unwrap().pending,
        1,
        "nothing was acked"
    );

    let mut config = engine_config(true);
    config.drain_patience = Duration::from_secs(30);
    let summary = drain_through(FaultyStore::new(store.clone(), 2), config).await;
    assert_eq!(summary.drain, Some(DrainEnd::Clean { arrived: 0 }));
    assert_eq!(summary.published, 1);
}

/// The harness's store with one row of key a, type `held`, and a publisher that holds that
/// type in flight until released.
async fn a_row_held_by_the_sink(h: &dyn Harness) -> (Arc<dyn OutboxStore>, RecordingPublisher) {
    let store = h.store();
    store
        .insert(vec![event("d", Some("a"), "held", 0)])
        .await
        .unwrap();
    let publisher = RecordingPublisher::new();
    publisher.hold("held");
    (store, publisher)
}

/// A row inserted while a drain runs is the next run's, even once its publish failed: the
/// drain ends clean, counting it as arrived (it exited 1 for it, as for a failed row of its
/// own, leaving a job that waits on the drain failed by traffic it was never asked to relay).
pub async fn engine_drain_leaves_a_failed_row_that_arrived_during_it_to_the_next_run(
    h: &dyn Harness,
) {
    let (store, publisher) = a_row_held_by_the_sink(h).await;
    publisher.fail("late", 1, PublishErrorKind::Unavailable);
    let mut config = engine_config(true);
    // The late row's retry comes after the drain has ended.
    config.settings.retry.base_delay = Duration::from_secs(600);
    config.settings.retry.max_delay = Duration::from_secs(600);
    let (engine, _stop) = spawn_engine(store.clone(), &publisher, config);
    crate::eventually(
        "the drain's row publishing",
        Duration::from_secs(10),
        || async { (publisher.holding() == 1).then_some(()) },
    )
    .await;
    let late = insert(&*store, &[("d", Some("b"), "late", 1)]).await;
    publisher.release("held");
    let summary = tokio::time::timeout(Duration::from_secs(60), engine)
        .await
        .expect("the drain ends")
        .unwrap()
        .unwrap();
    assert_eq!(summary.drain, Some(DrainEnd::Clean { arrived: 1 }));
    assert_eq!(
        attempts_of(&publisher, late[0]),
        1,
        "the late row was tried once"
    );
}

/// Under a store whose claims cannot leave a crowded key out (a capture's stream), a claim
/// that came back empty found nothing there: the engine's pause after such a claim, meant
/// for a polling claim that walked its window, held every other key's events until the
/// next poll (up to 2 s with the default poll interval; here, an hour).
pub async fn engine_a_crowded_key_delays_no_claim_of_a_store_that_cannot_leave_it_out(
    h: &dyn Harness,
) {
    use std::sync::atomic::Ordering::SeqCst;
    let (store, _) = store_with(
        h,
        &(0..4)
            .map(|n| ("d", Some("s"), "slow", n))
            .collect::<Vec<_>>(),
    )
    .await;
    let publisher = RecordingPublisher::new();
    publisher.hold("slow");
    let mut config = engine_config(false);
    config.wake = WakeMode::Notify;
    config.settings.poll_interval = Duration::from_secs(3600);
    // A key's share is 2: the slow key's 4 rows crowd it.
    config.settings.max_in_flight = 8;
    let faulty = Arc::new(FaultyStore {
        stream_like: Some(StreamLike::default()),
        ..FaultyStore::new(store.clone(), 0)
    });
    let (engine, stop) = spawn_engine(faulty.clone(), &publisher, config);
    let stream = faulty.stream_like.as_ref().unwrap();
    let wake = || (stream.wake.lock().unwrap().as_ref().unwrap())();
    crate::eventually(
        "the slow key's head publishing",
        Duration::from_secs(10),
        || async {
            (publisher.holding() == 1 && stream.wake.lock().unwrap().is_some()).then_some(())
        },
    )
    .await;
    // A wake-up with nothing new: an empty claim, the slow key crowded.
    let before = stream.empty.load(SeqCst);
    wake();
    let what = "an empty claim at the wake-up (none: claims paused after an earlier one)";
    crate::eventually(what, Duration::from_secs(10), || async {
        (stream.empty.load(SeqCst) > before).then_some(())
    })
    .await;
    let other = insert(&*store, &[("d", Some("b"), "t", 4)]).await;
    wake();
    let claims = stream.claims.load(SeqCst);
    crate::eventually_explained(
        "the other key's event delivered at its wake-up",
        Duration::from_secs(30),
        || {
            format!(
                "claims: {claims} before the wake-up, {} now",
                stream.claims.load(SeqCst)
            )
        },
        || async {
            let delivered = publisher.delivered();
            delivered
                .iter()
                .any(|e| e.sequence_id == other[0])
                .then_some(())
        },
    )
    .await;
    publisher.release("slow");
    let _ = stop.send(());
    engine.await.unwrap().unwrap();
}

/// A dead letter whose statement committed but whose answer was lost (the connection
/// dropped): the retry finds nothing to write, 0 rows, which reads as another node's fence.
/// The drain counted no dead letter and exited 0, the event dead.
pub async fn engine_a_dead_letter_whose_answer_was_lost_is_not_vouched_for(h: &dyn Harness) {
    let store = h.store();
    store
        .insert(vec![event("d", Some("a"), "poison", 0)])
        .await
        .unwrap();
    let publisher = RecordingPublisher::new();
    publisher.fail("poison", 100, PublishErrorKind::Rejected);
    let faulty = FaultyStore {
        lost_dead_letter_answers: 1.into(),
        ..FaultyStore::new(store.clone(), 0)
    };
    let summary = drain_through_to(faulty, &publisher, engine_config(true)).await;
    assert_eq!(store.backlog().await.unwrap().dead, 1, "dead-lettered once");
    assert_eq!(
        summary.dead_lettered + summary.dead_letters_unconfirmed,
        1,
        "the drain vouched for a dead event: {:?}",
        summary.drain
    );
}

/// A claim that committed its leases and lost its answer (the connection dropped): the node
/// did not hold those rows, and its own leases do not block its claims, so the next claim
/// took the key's later rows and published them first.
pub async fn engine_a_claim_whose_answer_was_lost_keeps_its_key_in_order(h: &dyn Harness) {
    let rows: Vec<_> = (0..10).map(|n| ("d", Some("a"), "t", n)).collect();
    let (store, seq) = store_with(h, &rows).await;
    let publisher = RecordingPublisher::new();
    let faulty = FaultyStore {
        lost_claim_answers: 1.into(),
        ..FaultyStore::new(store.clone(), 0)
    };
    let mut config = engine_config(true);
    // Short, so that before the fix the lost rows came back within the drain (after the
    // key's later rows); the fix does not wait for it.
    config.settings.lease = Duration::from_secs(2);
    let summary = drain_through_to(faulty, &publisher, config).await;
    assert_eq!(summary.published, 10);
    assert_eq!(
        delivered_ids(&publisher),
        seq,
        "the key's rows went out of order"
    );
}

/// Runs a drain on `store`, failing the test if it does not end.
async fn drain_through(store: FaultyStore, config: EngineConfig) -> Summary {
    drain_through_to(store, &RecordingPublisher::new(), config).await
}

/// [`drain_through`] to `publisher`.
async fn drain_through_to(
    store: FaultyStore,
    publisher: &RecordingPublisher,
    config: EngineConfig,
) -> Summary {
    let drain = outbox_engine::run(
        Arc::new(store),
        Arc::new(publisher.clone()),
        config,
        std::future::pending(),
    );
    // A bound on a hang, not on speed: failed claims back off to seconds between tries.
    tokio::time::timeout(Duration::from_secs(60), drain)
        .await
        .expect("the drain waited for a claim to succeed, without end")
        .unwrap()
}

/// The store, but its first `failures` claims fail as claims to a database that went away
/// do (retryable), and its first `fenced` dead letters are refused by the fence (nothing
/// written, 0 rows: the partition's lease was lost).
struct FaultyStore {
    store: Arc<dyn OutboxStore>,
    failures: std::sync::atomic::AtomicUsize,
    fenced: std::sync::atomic::AtomicUsize,
    /// Dead letters written whose answer is then lost (a retryable error after the commit).
    lost_dead_letter_answers: std::sync::atomic::AtomicUsize,
    /// Claims made whose answer is then lost: the rows stay leased to the node, which
    /// never hears of them.
    lost_claim_answers: std::sync::atomic::AtomicUsize,
    /// Claims as a capture's stream makes them: no key left out, woken by the test.
    stream_like: Option<StreamLike>,
}

/// What [`FaultyStore`] keeps when it claims as a capture's stream does.
#[derive(Default)]
struct StreamLike {
    /// The engine's wake-up, which the test calls.
    wake: std::sync::Mutex<Option<OnChange>>,
    /// Claims made, and how many of them came back empty.
    claims: std::sync::atomic::AtomicUsize,
    empty: Arc<std::sync::atomic::AtomicUsize>,
}

impl FaultyStore {
    const ERROR: &'static str = "the database went away (a fault of the test)";

    fn new(store: Arc<dyn OutboxStore>, failures: usize) -> Self {
        FaultyStore {
            store,
            failures: failures.into(),
            fenced: 0.into(),
            lost_dead_letter_answers: 0.into(),
            lost_claim_answers: 0.into(),
            stream_like: None,
        }
    }

    fn fencing_dead_letters(store: Arc<dyn OutboxStore>, fenced: usize) -> Self {
        FaultyStore {
            fenced: fenced.into(),
            ..FaultyStore::new(store, 0)
        }
    }
}

/// Takes one from `count` if it is above 0.
fn take_one(count: &std::sync::atomic::AtomicUsize) -> bool {
    use std::sync::atomic::Ordering::Relaxed;
    count
        .fetch_update(Relaxed, Relaxed, |n| n.checked_sub(1))
        .is_ok()
}

impl OutboxStore for FaultyStore {
    fn describe(&self) -> String {
        self.store.describe()
    }
    fn claim(&self, mut request: ClaimRequest) -> StoreFuture<Vec<Claimed>> {
        if take_one(&self.failures) {
            return Box::pin(async {
                Err(StoreError::new(StoreErrorKind::Connection, Self::ERROR))
            });
        }
        if take_one(&self.lost_claim_answers) {
            let claimed = self.store.claim(request);
            return Box::pin(async move {
                claimed.await?;
                Err(StoreError::new(StoreErrorKind::Connection, Self::ERROR))
            });
        }
        let Some(stream) = &self.stream_like else {
            return self.store.claim(request);
        };
        request.crowded = Crowded::default();
        stream
            .claims
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let empty = stream.empty.clone();
        let claim = self.store.claim(request);
        Box::pin(async move {
            let rows = claim.await?;
            if rows.is_empty() {
                empty.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
            Ok(rows)
        })
    }
    fn leaves_out_crowded_keys(&self) -> bool {
        self.stream_like.is_none() && self.store.leaves_out_crowded_keys()
    }
    fn ack(&self, holder: LeaseHolder, ids: Vec<SequenceId>) -> StoreFuture<u64> {
        self.store.ack(holder, ids)
    }
    fn retry_later(&self, holder: LeaseHolder, retries: Vec<RetryLater>) -> StoreFuture<u64> {
        self.store.retry_later(holder, retries)
    }
    fn dead_letter(&self, holder: LeaseHolder, entries: Vec<DeadLetter>) -> StoreFuture<u64> {
        if take_one(&self.fenced) {
            return Box::pin(async { Ok(0) });
        }
        if take_one(&self.lost_dead_letter_answers) {
            let written = self.store.dead_letter(holder, entries);
            return Box::pin(async move {
                written.await?;
                Err(StoreError::new(StoreErrorKind::Connection, Self::ERROR))
            });
        }
        self.store.dead_letter(holder, entries)
    }
    fn release(&self, node: NodeId, ids: Vec<SequenceId>) -> StoreFuture<u64> {
        self.store.release(node, ids)
    }
    fn release_unheld(&self, node: NodeId, held: Vec<SequenceId>) -> StoreFuture<u64> {
        self.store.release_unheld(node, held)
    }
    fn extend_leases(&self, extension: LeaseExtension) -> StoreFuture<u64> {
        self.store.extend_leases(extension)
    }
    fn backlog(&self) -> StoreFuture<Backlog> {
        self.store.backlog()
    }
    fn insert(&self, events: Vec<NewEvent>) -> StoreFuture<Vec<SequenceId>> {
        self.store.insert(events)
    }
    fn ping(&self) -> StoreFuture<()> {
        self.store.ping()
    }
    fn verify(&self) -> StoreFuture<Vec<Problem>> {
        self.store.verify()
    }
    fn subscribe(&self, on_change: OnChange) -> Option<BoxFuture<'static, ()>> {
        let Some(stream) = &self.stream_like else {
            return self.store.subscribe(on_change);
        };
        *stream.wake.lock().unwrap() = Some(on_change);
        Some(Box::pin(std::future::pending()))
    }
    fn give_way_to_shutdown(&self) -> Option<BoxFuture<'static, ()>> {
        self.store.give_way_to_shutdown()
    }
    fn set_waiting(&self, waiting: bool) {
        self.store.set_waiting(waiting)
    }
}

pub async fn engine_dead_letters_after_max_attempts_and_moves_on(h: &dyn Harness) {
    let (_, seq) = store_with(
        h,
        &[
            ("d", Some("a"), "doomed", 0),
            ("d", Some("a"), "t", 1),
            ("d", Some("b"), "fragile", 2),
        ],
    )
    .await;
    let publisher = RecordingPublisher::new();
    // The event's own failure (a destination's condition alone with nothing confirmed is
    // an outage, which spends no attempts: `engine_an_outage_spends_no_attempts`); a
    // timeout's first failure counts all the same, and fragile's limit is 1.
    publisher.fail("doomed", 100, PublishErrorKind::BrokerFailure);
    publisher.fail("fragile", 100, PublishErrorKind::Timeout);
    let summary = run_until_settled(h, &publisher, engine_config(false), &seq).await;
    assert_eq!(summary.dead_lettered, 2);
    let dead = h.dead_rows().await;
    let by_id: HashMap<_, _> = dead.iter().map(|d| (d.sequence_id, d)).collect();
    assert_eq!(by_id[&seq[0]].attempts, 3, "max_attempts");
    assert!(
        by_id[&seq[0]].last_error.contains("broker_failure"),
        "{}",
        by_id[&seq[0]].last_error
    );
    assert_eq!(by_id[&seq[2]].attempts, 1, "per-type max attempts");
    assert_eq!(
        delivered_ids(&publisher),
        vec![seq[1]],
        "the key carried on after its dead head"
    );
}

/// A sink down for longer than the retries last: its condition (unavailable), while it
/// confirms nothing, spends no attempt after each event's first failure. Counted, each
/// `down` event failing five times was dead-lettered at its third attempt. Nothing is
/// dead-lettered, and each key goes out in order once the sink is back: a failed row keeps
/// `attempts > 0`, which holds its key's later rows back in the store.
pub async fn engine_an_outage_spends_no_attempts(h: &dyn Harness) {
    let (_, seq) = store_with(
        h,
        &[
            ("d", Some("a"), "down", 0),
            ("d", Some("a"), "t", 1),
            ("d", Some("b"), "down", 2),
            ("d", Some("b"), "t", 3),
        ],
    )
    .await;
    let publisher = RecordingPublisher::new();
    publisher.fail("down", 10, PublishErrorKind::Unavailable);
    let summary = run_until_settled(h, &publisher, engine_config(false), &seq).await;
    assert_eq!(summary.dead_lettered, 0);
    assert_eq!(summary.published, 4);
    assert!(attempts_of(&publisher, seq[0]) + attempts_of(&publisher, seq[2]) > 10);
    let delivered = delivered_ids(&publisher);
    let of_key = |key: &[SequenceId]| -> Vec<SequenceId> {
        delivered
            .iter()
            .copied()
            .filter(|id| key.contains(id))
            .collect()
    };
    assert_eq!(of_key(&seq[..2]), seq[..2], "key a in order");
    assert_eq!(of_key(&seq[2..]), seq[2..], "key b in order");
}

/// One event the destination refuses alone (unavailable, a receiver's 503 to it only)
/// beside one failing for itself (a broker failure, a 500): the second says nothing of the
/// destination, so the first is still a lone failing event, and both are dead-lettered at
/// their attempts. Counted as the outage's evidence, the 500 left the 503s spending nothing,
/// and the first event was retried for good.
pub async fn engine_one_event_refused_beside_one_failing_for_itself_is_no_outage(h: &dyn Harness) {
    let (_, seq) = store_with(
        h,
        &[
            ("d", Some("a"), "refused", 0),
            ("d", Some("b"), "broken", 1),
        ],
    )
    .await;
    let publisher = RecordingPublisher::new();
    publisher.fail("refused", 100, PublishErrorKind::Unavailable);
    publisher.fail("broken", 100, PublishErrorKind::BrokerFailure);
    let summary = run_until_settled(h, &publisher, engine_config(false), &seq).await;
    assert_eq!(summary.dead_lettered, 2);
    assert_eq!(attempts_of(&publisher, seq[0]), 3, "max_attempts");
}

/// A head's dead letter the fence refused (its partition's lease lost, perhaps retaken in
/// the same round): the head is still pending in the table, yet its lane handed out the next
/// row, and the head, claimed again later, went out after it. The lane is given back, head
/// first, and the key goes out in order.
pub async fn engine_a_dead_letter_the_fence_refuses_keeps_its_key_in_order(h: &dyn Harness) {
    let (store, seq) = store_with(
        h,
        &[("d", Some("a"), "doomed", 0), ("d", Some("a"), "t", 1)],
    )
    .await;
    let publisher = RecordingPublisher::new();
    publisher.fail("doomed", 1, PublishErrorKind::Rejected);
    let fenced = Arc::new(FaultyStore::fencing_dead_letters(store, 1));
    run_until_settled_on(h, fenced, &publisher, engine_config(false), &seq).await;
    assert_eq!(
        delivered_ids(&publisher),
        seq,
        "the head, still in the table, went out first"
    );
}

pub async fn engine_dead_letters_permanent_errors_and_undecodable_rows(h: &dyn Harness) {
    let store = h.store();
    let first = store
        .insert(vec![event("d", Some("a"), "huge", 0)])
        .await
        .unwrap();
    let bad = h.insert_undecodable("d").await;
    let rest = store
        .insert((1..10).map(|n| event("d", Some("a"), "t", n)).collect())
        .await
        .unwrap();
    let publisher = RecordingPublisher::new();
    publisher.fail("huge", 1, PublishErrorKind::TooLarge);
    let summary = drained(store, &publisher).await;
    assert_eq!(summary.dead_lettered, 2);
    assert_eq!(summary.retried, 0, "permanent errors are not retried");
    let dead: HashSet<_> = h.dead_rows().await.iter().map(|d| d.sequence_id).collect();
    assert_eq!(dead, HashSet::from([first[0], bad]));
    assert_eq!(delivered_ids(&publisher), rest);
}
