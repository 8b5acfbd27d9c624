//! A 10 kB ordering key (composite ids and URLs can be that long) is claimed, retried and
//! holds back only its own key, ordered or not. SQLite's indexes take keys of any length;
//! this holds the store to what PostgreSQL's hashed blocking index had to be fixed for.

use std::time::Duration;

use outbox_core::store::{ClaimRequest, Claimed, RetryLater};
use outbox_core::{NewEvent, NodeId, OutboxStore};
use outbox_store_sqlite::SqliteStore;

async fn store() -> (tempfile::TempDir, SqliteStore) {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("outbox.db"), false).unwrap();
    store.migrate().await.unwrap();
    (dir, store)
}

/// 10 kB, distinct from the other long key only in its last byte.
fn long_key(last: char) -> String {
    format!("{}{last}", "x".repeat(10_239))
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

#[tokio::test]
async fn a_10kb_key_is_claimed_retried_and_delivered_without_ordering() {
    let (_dir, store) = store().await;
    store
        .insert(vec![event(&long_key('a'), 0), event("short", 1)])
        .await
        .unwrap();
    let node = NodeId("n1".into());
    let unordered = ClaimRequest {
        ordered: false,
        ..ClaimRequest::new(node.clone(), 100, Duration::from_secs(30))
    };
    let claimed = store.claim(unordered.clone()).await.unwrap();
    assert_eq!(payloads(&claimed), ["0", "1"]);
    store
        .retry_later(node.clone(), None, vec![retry(&claimed[0], Duration::ZERO)])
        .await
        .unwrap();
    store
        .ack(node.clone(), None, vec![claimed[1].sequence_id()])
        .await
        .unwrap();
    let again = store.claim(unordered).await.unwrap();
    assert_eq!(payloads(&again), ["0"]);
    store
        .ack(node, None, vec![again[0].sequence_id()])
        .await
        .unwrap();
    assert_eq!(store.backlog().await.unwrap().pending, 0);
}

#[tokio::test]
async fn a_10kb_key_waiting_to_retry_holds_back_only_its_own_key() {
    let (_dir, store) = store().await;
    store
        .insert(vec![
            event(&long_key('a'), 0),
            event(&long_key('a'), 1),
            event(&long_key('b'), 2),
        ])
        .await
        .unwrap();
    let (node, other) = (NodeId("n1".into()), NodeId("n2".into()));
    let claim = |node: &NodeId| ClaimRequest::new(node.clone(), 100, Duration::from_secs(30));
    let claimed = store.claim(claim(&node)).await.unwrap();
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
    assert_eq!(
        payloads(&store.claim(claim(&other)).await.unwrap()),
        ["2"],
        "1 waits behind its key's retry; the key differing in its last byte does not"
    );
}
