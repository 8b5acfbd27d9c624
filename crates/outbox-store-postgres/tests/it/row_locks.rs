//! A claim under row leases against an earlier row of the key that another transaction holds
//! locked at that moment: a node settling, releasing or extending it. SKIP LOCKED passes over
//! the locked row, and its last committed state (here a lapsed lease) blocks nothing; the
//! later row must still wait, or it goes out first. (WAL capture's parked table is claimed
//! this way: a million-event soak showed a relay that had just taken the slot deliver a
//! parked row ahead of an earlier one of its key that the previous holder was still writing.)

use std::time::Duration;

use outbox_core::store::{ClaimRequest, LeaseHolder};
use outbox_core::{NodeId, OutboxStore};
use outbox_store_postgres::{PgOptions, PgStore, Tables};
use outbox_testkit::conformance::{keyed_event as event, payloads};

use crate::conformance::connect;

async fn store() -> (PgStore, String) {
    let url = outbox_testkit::fresh_pg_database().await;
    let store = PgStore::new(PgOptions::new(url.as_str(), Tables::standard())).unwrap();
    store.migrate().await.unwrap();
    (store, url)
}

/// An outbox holding rows 0 and 1 of key `k`, and row 2 of another key.
async fn two_rows_of_k_and_one_other() -> (PgStore, String) {
    let (store, url) = store().await;
    store
        .insert(vec![event("k", 0), event("k", 1), event("other", 2)])
        .await
        .unwrap();
    (store, url)
}

/// Only the other key's row comes, while the first row of `k` is held elsewhere.
async fn only_the_other_key_comes(store: &PgStore) {
    let claimed = store.claim(claim_by("taker")).await.unwrap();
    assert_eq!(
        payloads(&claimed),
        ["2"],
        "the second row of `k` waits while its first is held elsewhere"
    );
}

fn claim_by(node: &str) -> ClaimRequest {
    ClaimRequest::new(NodeId(node.into()), 100, Duration::from_secs(30))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_racing_another_nodes_write_to_an_earlier_row_of_the_key_does_not_pass_it() {
    let (store, url) = two_rows_of_k_and_one_other().await;
    let client = connect(&url).await;
    // The first row of `k` as another node left it: leased, the lease lapsed.
    client
        .execute(
            "UPDATE outbox SET locked_by = 'previous', locked_until = now() - interval '1 second'
              WHERE payload::text = '0'",
            &[],
        )
        .await
        .unwrap();
    // That node writes to the row (its release, retry or lease extension), uncommitted.
    let writer = connect(&url).await;
    writer.batch_execute("BEGIN").await.unwrap();
    writer
        .execute(
            "UPDATE outbox SET locked_until = now() + interval '30 seconds'
              WHERE payload::text = '0' AND locked_by = 'previous'",
            &[],
        )
        .await
        .unwrap();

    only_the_other_key_comes(&store).await;

    // The write commits (the lease is the previous node's again): `k` stays blocked.
    writer.batch_execute("COMMIT").await.unwrap();
    assert!(store.claim(claim_by("taker")).await.unwrap().is_empty());
    // Once the lease lapses with no write in flight, the first row goes first.
    client
        .execute(
            "UPDATE outbox SET locked_until = now() - interval '1 second' WHERE locked_by = 'previous'",
            &[],
        )
        .await
        .unwrap();
    let claimed = store.claim(claim_by("taker")).await.unwrap();
    assert_eq!(payloads(&claimed), ["0", "1"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_does_not_pass_an_earlier_row_another_claim_in_flight_has_locked() {
    let (store, url) = two_rows_of_k_and_one_other().await;
    // Another node's claim, in flight: it has locked the first row of `k` (never leased:
    // nothing in its committed state blocks) and holds the key's lock, as the claim
    // statement takes them (the outbox's name and the key, hashed).
    let other = connect(&url).await;
    other.batch_execute("BEGIN").await.unwrap();
    other
        .query(
            "SELECT pg_try_advisory_xact_lock(hashtext('\"public\".\"outbox\"'),
                                              hashtext(coalesce(partition_key, destination)))
               FROM outbox WHERE payload::text = '0' FOR UPDATE",
            &[],
        )
        .await
        .unwrap();

    only_the_other_key_comes(&store).await;
    other.batch_execute("ROLLBACK").await.unwrap();
    let claimed = store.claim(claim_by("taker")).await.unwrap();
    assert_eq!(payloads(&claimed), ["0", "1"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_does_not_pass_an_earlier_row_released_and_still_locked_by_a_write_that_waited() {
    let (store, url) = two_rows_of_k_and_one_other().await;
    let previous = NodeId("previous".into());
    let ids: Vec<_> = store
        .claim(claim_by("previous"))
        .await
        .unwrap()
        .iter()
        .map(|c| c.sequence_id())
        .collect();
    assert_eq!(
        store.release(previous.clone(), ids.clone()).await.unwrap(),
        3
    );
    // A write that queued behind the release on the first row of `k` (the node's lease
    // extension, say): its recheck fails, and it holds the row locked until it commits.
    let writer = connect(&url).await;
    writer.batch_execute("BEGIN").await.unwrap();
    writer
        .query(
            "SELECT 1 FROM outbox WHERE payload::text = '0' FOR UPDATE",
            &[],
        )
        .await
        .unwrap();

    only_the_other_key_comes(&store).await;

    writer.batch_execute("COMMIT").await.unwrap();
    let claimed = store.claim(claim_by("taker")).await.unwrap();
    assert_eq!(payloads(&claimed), ["0", "1"]);
    // Released rows are no longer the releasing node's to settle or extend.
    assert_eq!(
        store
            .ack(LeaseHolder::unfenced(previous), ids)
            .await
            .unwrap(),
        0
    );
}
