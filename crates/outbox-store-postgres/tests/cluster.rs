//! Partition leases, fencing epochs and the claim modes, against real PostgreSQL.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::store::{ClaimRequest, PartitionRegistry};
use outbox_core::{partition_of, Claimed, Fence, NewEvent, NodeId, OutboxStore};
use outbox_store_postgres::{PgOptions, PgStore, Tables, DEFAULT_NOTIFY_CHANNEL};
use outbox_testkit::eventually;

async fn store(partitions: u32) -> (PgStore, String) {
    let url = outbox_testkit::fresh_pg_database().await;
    let mut tables = Tables::new(
        "public",
        "outbox",
        "public",
        "outbox_nodes",
        DEFAULT_NOTIFY_CHANNEL,
    )
    .unwrap();
    tables.partition_count = partitions;
    let store = PgStore::new(PgOptions {
        url: url.clone(),
        tables,
        retain_delivered: false,
        ca_file: None,
        pool_size: 4,
    })
    .unwrap();
    store.migrate().await.unwrap();
    (store, url)
}

fn event(key: &str, n: usize) -> NewEvent {
    NewEvent {
        destination: "d".into(),
        partition_key: Some(key.into()),
        event_type: "t".into(),
        payload: Some(format!("{n}")),
        ..NewEvent::default()
    }
}

fn owned(node: &NodeId, fence: Fence, limit: usize) -> ClaimRequest {
    ClaimRequest {
        fence: Some(Arc::new(fence)),
        ..ClaimRequest::new(node.clone(), limit, Duration::from_secs(30))
    }
}

fn ids(claimed: &[Claimed]) -> Vec<i64> {
    claimed.iter().map(Claimed::sequence_id).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_and_rust_agree_on_partitions() {
    let (_, url) = store(64).await;
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let keys: Vec<String> = (0..500)
        .map(|i| format!("key-{i}-ü"))
        .chain(["".to_string()])
        .collect();
    let rows = client
        .query(
            "SELECT k, outbox_partition(k, 64) FROM unnest($1::text[]) AS k",
            &[&keys],
        )
        .await
        .unwrap();
    for row in rows {
        let key: String = row.get(0);
        assert_eq!(row.get::<_, i32>(1), partition_of(&key, 64), "key {key:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_are_exclusive_and_each_takeover_bumps_the_epoch() {
    let (store, _) = store(8).await;
    assert_eq!(store.partition_count().await.unwrap(), 8);
    let (a, b) = (NodeId::random(), NodeId::random());
    let taken = store
        .acquire(a.clone(), vec![0, 1], Duration::from_millis(400))
        .await
        .unwrap();
    assert_eq!(taken, vec![(0, 1), (1, 1)]);
    assert!(
        store
            .acquire(b.clone(), vec![0, 1, 2], Duration::from_secs(30))
            .await
            .unwrap()
            == vec![(2, 1)],
        "0 and 1 are leased"
    );
    // A's lease runs out; B takes over with a higher epoch; A can no longer renew.
    let retaken = eventually("A's lease to expire", Duration::from_secs(10), || {
        let store = store.clone();
        let b = b.clone();
        async move {
            let t = store
                .acquire(b, vec![0], Duration::from_secs(30))
                .await
                .unwrap();
            (!t.is_empty()).then_some(t)
        }
    })
    .await;
    assert_eq!(retaken, vec![(0, 2)]);
    // Partition 1's lease ran out too, and nobody took it: A cannot renew it either (a lease
    // of one epoch is unbroken), but takes it again at the next epoch.
    let renewed = store
        .renew(a.clone(), vec![(0, 1), (1, 1)], Duration::from_secs(30))
        .await
        .unwrap();
    assert!(
        renewed.is_empty(),
        "lapsed leases are not renewed: {renewed:?}"
    );
    let again = store
        .acquire(a.clone(), vec![1], Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(again, vec![(1, 2)]);
    let renewed = store
        .renew(a.clone(), again, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(renewed, vec![1], "a live lease is renewed");
    assert_eq!(
        store
            .release_partitions(b.clone(), vec![0, 2])
            .await
            .unwrap(),
        2
    );
    let records = store.partitions().await.unwrap();
    assert_eq!(records[0].owner, None);
    assert_eq!(
        records[0].epoch, 2,
        "the epoch stays; the next owner gets 3"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_lost_its_partitions_cannot_settle_and_the_new_owner_takes_the_rows() {
    let (store, _) = store(4).await;
    let seq = store
        .insert((0..20).map(|i| event(&format!("k{}", i % 5), i)).collect())
        .await
        .unwrap();
    let (a, b) = (NodeId::random(), NodeId::random());
    let all = vec![0, 1, 2, 3];
    let a_epochs = store
        .acquire(a.clone(), all.clone(), Duration::from_millis(300))
        .await
        .unwrap();
    let a_fence = Fence {
        count: 4,
        partitions: all.clone(),
        epochs: a_epochs.iter().map(|(_, e)| *e).collect(),
    };
    let claimed = store.claim(owned(&a, a_fence.clone(), 100)).await.unwrap();
    assert_eq!(ids(&claimed), seq, "A holds every partition");

    // A stalls past its partition leases (its row leases, 30 s, are still live); B takes over.
    let b_epochs = eventually(
        "A's partition leases to expire",
        Duration::from_secs(10),
        || {
            let store = store.clone();
            let (b, all) = (b.clone(), all.clone());
            async move {
                let t = store
                    .acquire(b, all, Duration::from_secs(30))
                    .await
                    .unwrap();
                (t.len() == 4).then_some(t)
            }
        },
    )
    .await;
    let b_fence = Fence {
        count: 4,
        partitions: all.clone(),
        epochs: b_epochs.iter().map(|(_, e)| *e).collect(),
    };
    assert!(
        b_fence
            .epochs
            .iter()
            .zip(&a_fence.epochs)
            .all(|(b, a)| b > a),
        "takeover bumps epochs"
    );
    let reclaimed = store.claim(owned(&b, b_fence.clone(), 100)).await.unwrap();
    assert_eq!(
        ids(&reclaimed),
        seq,
        "the new owner does not wait for the old row leases"
    );

    // A wakes up: everything it tries to settle is fenced.
    let a_fence = Some(Arc::new(a_fence));
    assert_eq!(
        store
            .ack(a.clone(), a_fence.clone(), seq.clone())
            .await
            .unwrap(),
        0
    );
    let retry = vec![outbox_core::store::RetryLater {
        sequence_id: seq[0],
        attempts: 1,
        error: "x".into(),
        delay: Duration::ZERO,
    }];
    assert_eq!(
        store
            .retry_later(a.clone(), a_fence.clone(), retry)
            .await
            .unwrap(),
        0
    );
    let dead = vec![outbox_core::store::DeadLetter {
        sequence_id: seq[1],
        attempts: 1,
        error: "x".into(),
    }];
    assert_eq!(store.dead_letter(a, a_fence, dead).await.unwrap(), 0);
    // B settles.
    assert_eq!(
        store
            .ack(b, Some(Arc::new(b_fence)), seq.clone())
            .await
            .unwrap(),
        20
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owned_claims_cover_only_the_fence_and_unordered_claims_ignore_keys() {
    let (store, _) = store(4).await;
    let keys: Vec<String> = (0..40).map(|i| format!("key{i}")).collect();
    let seq = store
        .insert(keys.iter().enumerate().map(|(i, k)| event(k, i)).collect())
        .await
        .unwrap();
    let node = NodeId::random();
    let taken = store
        .acquire(node.clone(), vec![1, 3], Duration::from_secs(30))
        .await
        .unwrap();
    let fence = Fence {
        count: 4,
        partitions: vec![1, 3],
        epochs: taken.iter().map(|(_, e)| *e).collect(),
    };
    let claimed = store.claim(owned(&node, fence, 100)).await.unwrap();
    let expected: Vec<i64> = seq
        .iter()
        .zip(&keys)
        .filter(|(_, k)| [1, 3].contains(&partition_of(k, 4)))
        .map(|(s, _)| *s)
        .collect();
    assert_eq!(ids(&claimed), expected);

    // A retrying head blocks its key in ordered claims, not in unordered ones.
    let (store, _) = store_with_retrying_head().await;
    let other = NodeId::random();
    let ordered = store
        .claim(ClaimRequest::new(
            other.clone(),
            10,
            Duration::from_secs(30),
        ))
        .await
        .unwrap();
    assert!(ordered.is_empty(), "the key waits for its head");
    let unordered = store
        .claim(ClaimRequest {
            ordered: false,
            ..ClaimRequest::new(other, 10, Duration::from_secs(30))
        })
        .await
        .unwrap();
    assert_eq!(
        unordered.len(),
        1,
        "unordered claims take the later row at once"
    );
}

/// A node holding every partition of a 4-partition store.
async fn sole_owner(store: &PgStore) -> (NodeId, Fence) {
    let node = NodeId::random();
    let taken = store
        .acquire(node.clone(), vec![0, 1, 2, 3], Duration::from_secs(60))
        .await
        .unwrap();
    let fence = Fence {
        count: 4,
        partitions: vec![0, 1, 2, 3],
        epochs: taken.iter().map(|(_, e)| *e).collect(),
    };
    (node, fence)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_do_not_pass_an_insert_that_commits_after_later_rows() {
    let (store, url) = store(4).await;
    let (node, fence) = sole_owner(&store).await;
    let (writer, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    // An application transaction draws its id and stays open while later rows commit.
    writer
        .batch_execute(
            "BEGIN; INSERT INTO outbox (destination, partition_key, event_type, payload)
                    VALUES ('d', 'slow', 't', '0')",
        )
        .await
        .unwrap();
    let mut later = Vec::new();
    for round in 0..3 {
        let seq = store
            .insert((0..5).map(|i| event(&format!("k{i}"), round)).collect())
            .await
            .unwrap();
        later.extend(seq);
        let claimed = store.claim(owned(&node, fence.clone(), 100)).await.unwrap();
        assert!(
            claimed.iter().all(|c| later.contains(&c.sequence_id())),
            "only committed rows"
        );
    }
    writer.batch_execute("COMMIT").await.unwrap();
    let slow: i64 = writer
        .query_one(
            "SELECT sequence_id FROM outbox WHERE partition_key = 'slow'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(slow < later[0], "the open insert drew the lowest id");
    let claimed = store.claim(owned(&node, fence.clone(), 100)).await.unwrap();
    assert_eq!(
        ids(&claimed),
        vec![slow],
        "the row committed last is claimed at once, below rows already claimed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_that_retries_is_claimed_again_when_due_before_its_keys_later_rows() {
    let (store, url) = store(4).await;
    let (node, fence) = sole_owner(&store).await;
    let seq = store
        .insert(vec![event("k", 0), event("other", 1), event("k", 2)])
        .await
        .unwrap();
    let claimed = store.claim(owned(&node, fence.clone(), 2)).await.unwrap();
    assert_eq!(ids(&claimed), seq[..2]);
    let retry = vec![outbox_core::store::RetryLater {
        sequence_id: seq[0],
        attempts: 1,
        error: "down".into(),
        delay: Duration::from_millis(300),
    }];
    let f = Some(Arc::new(fence.clone()));
    assert_eq!(store.retry_later(node.clone(), f, retry).await.unwrap(), 1);
    let waiting = store.claim(owned(&node, fence.clone(), 10)).await.unwrap();
    assert!(
        waiting.is_empty(),
        "the key waits for its head: {:?}",
        ids(&waiting)
    );
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let client = Arc::new(client);
    let head = seq[0];
    eventually("the retry to come due", Duration::from_secs(10), || {
        let client = client.clone();
        async move {
            let due: bool = client
                .query_one(
                    "SELECT available_at <= now() FROM outbox WHERE sequence_id = $1",
                    &[&head],
                )
                .await
                .unwrap()
                .get(0);
            due.then_some(())
        }
    })
    .await;
    let claimed = store.claim(owned(&node, fence, 10)).await.unwrap();
    assert_eq!(
        ids(&claimed),
        vec![seq[0], seq[2]],
        "the head first, at once"
    );
}

/// A store whose key "k" has a head waiting an hour to retry and one row behind it.
async fn store_with_retrying_head() -> (PgStore, String) {
    let (store, url) = store(4).await;
    let seq = store
        .insert(vec![event("k", 0), event("k", 1)])
        .await
        .unwrap();
    let node = NodeId::random();
    store
        .claim(ClaimRequest::new(node.clone(), 1, Duration::from_secs(30)))
        .await
        .unwrap();
    let retry = vec![outbox_core::store::RetryLater {
        sequence_id: seq[0],
        attempts: 1,
        error: "down".into(),
        delay: Duration::from_secs(3600),
    }];
    assert_eq!(store.retry_later(node, None, retry).await.unwrap(), 1);
    (store, url)
}
