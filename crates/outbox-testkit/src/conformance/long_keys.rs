//! Ordering keys longer than a btree index row (about 2.7 kB): composite ids and URLs are
//! sometimes that long, and one such key must never stall its key, nor the outbox. (PostgreSQL
//! had to hash its blocking index for this; other stores are held to the same.)

use std::sync::Arc;
use std::time::Duration;

use outbox_core::store::{ClaimRequest, LeaseHolder, RetryLater};
use outbox_core::{Claimed, Fence, NewEvent, NodeId, OutboxStore};

use super::Harness;

/// 10 kB that PostgreSQL cannot compress below the index row limit (a repeated character
/// would compress to a few bytes), ending in `last`: two such keys differ only in their last
/// byte, so an index of a prefix would merge them.
pub fn long_key(last: char) -> String {
    format!("{}{last}", incompressible(10_239))
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

/// An event of `key` whose payload is `n`.
pub fn keyed_event(key: &str, n: usize) -> NewEvent {
    NewEvent {
        destination: "d".into(),
        partition_key: Some(key.into()),
        event_type: "t".into(),
        payload: Some(format!("{n}")),
        ..NewEvent::default()
    }
}

/// The payloads of claimed events, as text.
pub fn payloads(claimed: &[Claimed]) -> Vec<String> {
    claimed
        .iter()
        .map(|c| match c {
            Claimed::Event(e) => String::from_utf8_lossy(e.payload.as_bytes()).into_owned(),
            Claimed::Undecodable { reason, .. } => panic!("undecodable: {reason}"),
        })
        .collect()
}

/// A first retry of `claimed` after `delay`.
pub fn retry(claimed: &Claimed, delay: Duration) -> RetryLater {
    RetryLater {
        sequence_id: claimed.sequence_id(),
        attempts: 1,
        error: "broker said no".into(),
        delay,
    }
}

/// Inserts: 0 and 1 under the long key, 2 under the other long key, 3 under a short one.
async fn four_events(store: &dyn OutboxStore) {
    store
        .insert(vec![
            keyed_event(&long_key('a'), 0),
            keyed_event(&long_key('a'), 1),
            keyed_event(&long_key('b'), 2),
            keyed_event("short", 3),
        ])
        .await
        .unwrap();
}

pub async fn a_10kb_key_is_claimed_retried_and_delivered_without_ordering(h: &dyn Harness) {
    let store = h.store();
    four_events(&*store).await;
    let node = NodeId::random();
    let unordered = ClaimRequest {
        ordered: false,
        ..ClaimRequest::new(node.clone(), 100, Duration::from_secs(30))
    };
    // The claim leases every row, so the long keys enter the blocking index.
    let claimed = store.claim(unordered.clone()).await.unwrap();
    assert_eq!(payloads(&claimed), ["0", "1", "2", "3"]);
    let retried = store
        .retry_later(
            LeaseHolder::unfenced(node.clone()),
            vec![retry(&claimed[0], Duration::ZERO)],
        )
        .await
        .unwrap();
    assert_eq!(retried, 1);
    store
        .ack(
            LeaseHolder::unfenced(node.clone()),
            claimed[1..].iter().map(Claimed::sequence_id).collect(),
        )
        .await
        .unwrap();
    let again = store.claim(unordered).await.unwrap();
    assert_eq!(payloads(&again), ["0"], "the retried event comes back");
    store
        .ack(LeaseHolder::unfenced(node), vec![again[0].sequence_id()])
        .await
        .unwrap();
    assert_eq!(store.backlog().await.unwrap().pending, 0);
}

pub async fn a_10kb_key_waiting_to_retry_holds_back_only_its_own_key_under_row_leases(
    h: &dyn Harness,
) {
    let store = h.store();
    four_events(&*store).await;
    let (node, other) = (NodeId::random(), NodeId::random());
    let claim = |node: &NodeId| ClaimRequest::new(node.clone(), 100, Duration::from_secs(30));
    let claimed = store.claim(claim(&node)).await.unwrap();
    assert_eq!(payloads(&claimed), ["0", "1", "2", "3"]);
    // The head of the long key must retry in an hour; its lane's next row goes back.
    let retried = store
        .retry_later(
            LeaseHolder::unfenced(node.clone()),
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
            LeaseHolder::unfenced(node.clone()),
            vec![claimed[2].sequence_id(), claimed[3].sequence_id()],
        )
        .await
        .unwrap();
    store
        .insert(vec![
            keyed_event(&long_key('b'), 4),
            keyed_event("short", 5),
        ])
        .await
        .unwrap();
    let next = store.claim(claim(&other)).await.unwrap();
    assert_eq!(
        payloads(&next),
        ["4", "5"],
        "1 waits behind its key's retry; the key differing in its last byte does not"
    );
}

pub async fn a_10kb_key_waiting_to_retry_holds_back_only_its_own_key_in_owned_partitions(
    h: &dyn Harness,
) {
    let registry = h
        .partitions()
        .expect("a store without partition leases marks owned_partitions not applicable");
    let store = h.store();
    four_events(&*store).await;
    let node = NodeId::random();
    let count = registry.partition_count().await.unwrap();
    let all: Vec<i32> = (0..count as i32).collect();
    let epochs = registry
        .acquire(node.clone(), all.clone(), Duration::from_secs(30))
        .await
        .unwrap();
    let fence = Arc::new(Fence {
        count,
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
            LeaseHolder {
                node: node.clone(),
                fence: Some(fence.clone()),
            },
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
            LeaseHolder {
                node: node.clone(),
                fence: Some(fence.clone()),
            },
            vec![claimed[2].sequence_id(), claimed[3].sequence_id()],
        )
        .await
        .unwrap();
    store
        .insert(vec![
            keyed_event(&long_key('b'), 4),
            keyed_event("short", 5),
        ])
        .await
        .unwrap();
    let next = store.claim(owned.clone()).await.unwrap();
    assert_eq!(
        payloads(&next),
        ["4", "5"],
        "1 waits behind its key's retry; the key differing in its last byte does not"
    );
}
