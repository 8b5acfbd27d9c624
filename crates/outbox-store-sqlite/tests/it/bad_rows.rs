//! Rows only SQLite accepts that the relay cannot publish: bytes that are not UTF-8 in a text
//! column (PostgreSQL and MariaDB refuse them at insert) are claimed as undecodable,
//! dead-lettered with their reason and their bytes intact, and the other rows flow. The cases
//! every store shares (odd `created_at` values, a renamed column) are in the conformance suite.

use std::time::{Duration, SystemTime};

use outbox_core::store::{ClaimRequest, Claimed, DeadLetter};
use outbox_core::{NodeId, OutboxStore};
use outbox_store_sqlite::SqliteStore;

async fn store() -> (tempfile::TempDir, SqliteStore) {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("outbox.db"), false).unwrap();
    store.migrate().await.unwrap();
    (dir, store)
}

/// Claims everything and dead-letters the undecodable rows, as the engine does; returns the
/// events (destination, created_at) and the reasons.
async fn claim_and_settle(store: &SqliteStore) -> (Vec<(String, SystemTime)>, Vec<String>) {
    let node = NodeId("n1".into());
    let claimed = store
        .claim(ClaimRequest::new(
            node.clone(),
            100,
            Duration::from_secs(30),
        ))
        .await
        .expect("one bad row never fails the claim");
    let mut events = Vec::new();
    let mut dead = Vec::new();
    for c in claimed {
        match c {
            Claimed::Event(e) => events.push((e.destination.clone(), e.created_at)),
            Claimed::Undecodable {
                sequence_id,
                reason,
                ..
            } => dead.push(DeadLetter {
                sequence_id,
                attempts: 1,
                error: reason,
            }),
        }
    }
    let reasons = dead.iter().map(|d| d.error.clone()).collect();
    let n = dead.len() as u64;
    assert_eq!(store.dead_letter(node, None, dead).await.unwrap(), n);
    (events, reasons)
}

#[tokio::test]
async fn invalid_utf8_in_destination_or_key_is_dead_lettered_and_other_rows_flow() {
    let (_dir, store) = store().await;
    store
        .batch_execute(
            "INSERT INTO outbox (destination, partition_key, event_type) VALUES
               (CAST(X'64FF' AS TEXT), NULL, 't'),
               ('orders', CAST(X'6BFE' AS TEXT), 't'),
               ('orders', 'k', CAST(X'C3' AS TEXT)),
               ('orders', 'k2', 't')",
        )
        .await
        .unwrap();
    let (events, reasons) = claim_and_settle(&store).await;
    assert_eq!(events.len(), 1, "{events:?} {reasons:?}");
    assert_eq!(events[0].0, "orders");
    assert_eq!(reasons.len(), 3, "{reasons:?}");
    for (reason, column) in reasons
        .iter()
        .zip(["destination", "partition_key", "event_type"])
    {
        assert!(
            reason.starts_with(&format!("{column} is not UTF-8 text")),
            "{reason}"
        );
        assert!(reason.contains("dead retry"), "{reason}");
    }
    // The dead letters keep the bytes as they were.
    let dir = _dir.path().join("outbox.db");
    let conn = rusqlite::Connection::open(dir).unwrap();
    let bytes: Vec<u8> = conn
        .query_row(
            "SELECT CAST(destination AS BLOB) FROM outbox_dead_letters ORDER BY sequence_id LIMIT 1",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(bytes, [0x64, 0xFF]);
}
