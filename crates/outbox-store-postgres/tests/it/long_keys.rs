//! Ordering keys longer than a btree index row (about 2.7 kB): composite ids and URLs are
//! sometimes that long, and one such key must never stall its key, nor the outbox.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::store::{ClaimRequest, PartitionRegistry, RetryLater};
use outbox_core::{Claimed, Fence, NewEvent, NodeId, OutboxStore};
use outbox_store_postgres::{PgOptions, PgStore, Tables};

const PARTITIONS: u32 = 4;

async fn store() -> (PgStore, String) {
    let url = outbox_testkit::fresh_pg_database().await;
    let mut tables = Tables::standard();
    tables.partition_count = PARTITIONS;
    let store = PgStore::new(PgOptions::new(url.as_str(), tables)).unwrap();
    store.migrate().await.unwrap();
    (store, url)
}

/// 10 kB that PostgreSQL cannot compress below the index row limit (a repeated character
/// would compress to a few bytes), and distinct from [`other_long_key`] only in its last
/// byte: an index of a prefix would merge the two.
fn long_key() -> String {
    format!("{}a", incompressible(10_239))
}

fn other_long_key() -> String {
    format!("{}b", incompressible(10_239))
}

/// Pseudo-random letters and digits (a fixed xorshift sequence).
fn incompressible(len: usize) -> String {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ALPHABET[(state % ALPHABET.len() as u64) as usize] as char
        })
        .collect()
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

fn payloads(claimed: &[Claimed]) -> Vec<String> {
    claimed
        .iter()
        .map(|c| match c {
            Claimed::Event(e) => String::from_utf8_lossy(e.payload.as_bytes()).into_owned(),
            Claimed::Undecodable { reason, .. } => panic!("undecodable: {reason}"),
        })
        .collect()
}

fn retry(claimed: &Claimed, delay: Duration) -> RetryLater {
    RetryLater {
        sequence_id: claimed.sequence_id(),
        attempts: 1,
        error: "broker said no".into(),
        delay,
    }
}

/// Inserts: 0 and 1 under the long key, 2 under the other long key, 3 under a short one.
async fn four_events(store: &PgStore) {
    store
        .insert(vec![
            event(&long_key(), 0),
            event(&long_key(), 1),
            event(&other_long_key(), 2),
            event("short", 3),
        ])
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_10kb_key_is_claimed_retried_and_delivered_without_ordering() {
    let (store, _) = store().await;
    four_events(&store).await;
    let node = NodeId::random();
    let unordered = ClaimRequest {
        ordered: false,
        ..ClaimRequest::new(node.clone(), 100, Duration::from_secs(30))
    };
    // The claim leases every row, so the long keys enter the blocking index.
    let claimed = store.claim(unordered.clone()).await.unwrap();
    assert_eq!(payloads(&claimed), ["0", "1", "2", "3"]);
    let retried = store
        .retry_later(node.clone(), None, vec![retry(&claimed[0], Duration::ZERO)])
        .await
        .unwrap();
    assert_eq!(retried, 1);
    store
        .ack(
            node.clone(),
            None,
            claimed[1..].iter().map(Claimed::sequence_id).collect(),
        )
        .await
        .unwrap();
    let again = store.claim(unordered).await.unwrap();
    assert_eq!(payloads(&again), ["0"], "the retried event comes back");
    store
        .ack(node, None, vec![again[0].sequence_id()])
        .await
        .unwrap();
    assert_eq!(store.backlog().await.unwrap().pending, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_10kb_key_waiting_to_retry_holds_back_only_its_own_key_under_row_leases() {
    let (store, _) = store().await;
    four_events(&store).await;
    let (node, other) = (NodeId::random(), NodeId::random());
    let claim = |node: &NodeId| ClaimRequest::new(node.clone(), 100, Duration::from_secs(30));
    let claimed = store.claim(claim(&node)).await.unwrap();
    assert_eq!(payloads(&claimed), ["0", "1", "2", "3"]);
    // The head of the long key must retry in an hour; its lane's next row goes back.
    let retried = store
        .retry_later(
            node.clone(),
            None,
            vec![retry(&claimed[0], Duration::from_secs(3600))],
        )
        .await
        .unwrap();
    assert_eq!(retried, 1);
    store
        .release(node.clone(), vec![claimed[1].sequence_id()])
        .await
        .unwrap();
    store
        .ack(
            node.clone(),
            None,
            vec![claimed[2].sequence_id(), claimed[3].sequence_id()],
        )
        .await
        .unwrap();
    store
        .insert(vec![event(&other_long_key(), 4), event("short", 5)])
        .await
        .unwrap();
    let next = store.claim(claim(&other)).await.unwrap();
    assert_eq!(
        payloads(&next),
        ["4", "5"],
        "1 waits behind its key's retry; the key differing in its last byte does not"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_10kb_key_waiting_to_retry_holds_back_only_its_own_key_in_owned_partitions() {
    let (store, _) = store().await;
    four_events(&store).await;
    let node = NodeId::random();
    let all: Vec<i32> = (0..PARTITIONS as i32).collect();
    let epochs = store
        .acquire(node.clone(), all.clone(), Duration::from_secs(30))
        .await
        .unwrap();
    let fence = Arc::new(Fence {
        count: PARTITIONS,
        partitions: all,
        epochs: epochs.iter().map(|(_, e)| *e).collect(),
    });
    let owned = ClaimRequest {
        fence: Some(fence.clone()),
        ..ClaimRequest::new(node.clone(), 100, Duration::from_secs(30))
    };
    let claimed = store.claim(owned.clone()).await.unwrap();
    assert_eq!(payloads(&claimed), ["0", "1", "2", "3"]);
    // Owned claims lease nothing: the retry is what puts the long key into the blocking index.
    let retried = store
        .retry_later(
            node.clone(),
            Some(fence.clone()),
            vec![retry(&claimed[0], Duration::from_secs(3600))],
        )
        .await
        .unwrap();
    assert_eq!(retried, 1);
    store
        .release(node.clone(), vec![claimed[1].sequence_id()])
        .await
        .unwrap();
    store
        .ack(
            node.clone(),
            Some(fence.clone()),
            vec![claimed[2].sequence_id(), claimed[3].sequence_id()],
        )
        .await
        .unwrap();
    store
        .insert(vec![event(&other_long_key(), 4), event("short", 5)])
        .await
        .unwrap();
    let next = store.claim(owned.clone()).await.unwrap();
    assert_eq!(
        payloads(&next),
        ["4", "5"],
        "1 waits behind its key's retry; the key differing in its last byte does not"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outbox_migrated_by_an_earlier_version_keeps_its_key_order_until_migrate_replaces_the_index(
) {
    let (store, url) = store().await;
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    // The blocking index as earlier versions created it, over the key itself, in a schema
    // from before versions (no version recorded).
    client
        .batch_execute(
            "DROP TABLE outbox_versions;
             DROP INDEX outbox_key_blockers_idx;
             CREATE INDEX outbox_blocking_idx ON outbox ((coalesce(partition_key, destination)), sequence_id)
                 WHERE delivered_at IS NULL AND (locked_by IS NOT NULL OR attempts > 0);",
        )
        .await
        .unwrap();
    let problems = store.verify().await.unwrap();
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(
        problems[0].is_degraded()
            && problems[0]
                .what
                .contains("\"outbox_blocking_idx\" is from an earlier version")
            && problems[0].what.contains("2.7 kB")
            && problems[0].fix.contains("outbox-relay migrate"),
        "{problems:?}"
    );

    // The relay runs on it: a key waiting to retry still holds back its later rows.
    store
        .insert(vec![event("k", 0), event("k", 1), event("other", 2)])
        .await
        .unwrap();
    let node = NodeId::random();
    let claim = || ClaimRequest::new(node.clone(), 100, Duration::from_secs(30));
    let claimed = store.claim(claim()).await.unwrap();
    assert_eq!(payloads(&claimed), ["0", "1", "2"]);
    store
        .retry_later(
            node.clone(),
            None,
            vec![retry(&claimed[0], Duration::from_secs(3600))],
        )
        .await
        .unwrap();
    store
        .release(
            node.clone(),
            vec![claimed[1].sequence_id(), claimed[2].sequence_id()],
        )
        .await
        .unwrap();
    assert_eq!(payloads(&store.claim(claim()).await.unwrap()), ["2"]);

    // `migrate` swaps the indexes, and long keys then work.
    store.migrate().await.unwrap();
    assert_eq!(store.verify().await.unwrap(), vec![]);
    let indexes: Vec<String> = client
        .query(
            "SELECT indexname::text FROM pg_indexes WHERE tablename = 'outbox' AND indexname LIKE '%block%'",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(indexes, ["outbox_key_blockers_idx"]);
    store.insert(vec![event(&long_key(), 3)]).await.unwrap();
    assert_eq!(payloads(&store.claim(claim()).await.unwrap()), ["3"]);
}
