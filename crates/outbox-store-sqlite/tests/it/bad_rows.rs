//! Rows only SQLite accepts that the relay cannot publish: bytes that are not UTF-8 in a text
//! column (PostgreSQL and MariaDB refuse them at insert) are claimed as undecodable,
//! dead-lettered with their reason and their bytes intact, and the other rows flow. The cases
//! every store shares (odd `created_at` values, a renamed column) are in the conformance suite.

use outbox_store_sqlite::SqliteStore;
use outbox_testkit::conformance::claim_and_settle;

async fn store() -> (tempfile::TempDir, SqliteStore) {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("outbox.db"), false).unwrap();
    store.migrate().await.unwrap();
    (dir, store)
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

    // The operator can still list and look at them: `stats`, `dead list` and the event
    // failed on the first row that is not UTF-8 (rusqlite refuses it as a String).
    use outbox_core::store::{DeadQuery, Operations};
    store
        .batch_execute(
            "INSERT INTO outbox (destination, partition_key, event_type, available_at, attempts)
               VALUES (CAST(X'65FF' AS TEXT), NULL, CAST(X'C3' AS TEXT), 253402300799000, 1)",
        )
        .await
        .unwrap();
    let stats = store.destination_stats().await.unwrap();
    assert!(
        stats
            .iter()
            .any(|s| s.destination == "d\u{FFFD}" && s.dead == 1),
        "{stats:?}"
    );
    assert!(
        stats
            .iter()
            .any(|s| s.destination == "e\u{FFFD}" && s.pending == 1),
        "{stats:?}"
    );
    let all = DeadQuery {
        limit: 100,
        ..DeadQuery::default()
    };
    let dead = store.dead_list(all).await.unwrap();
    assert_eq!(dead.len(), 3, "{dead:?}");
    assert_eq!(dead[0].destination, "d\u{FFFD}");
    let shown = store.event(dead[2].sequence_id).await.unwrap().unwrap();
    assert_eq!(shown.event_type, "\u{FFFD}");
}

/// SQLite keeps `available_at` as Unix milliseconds, but takes any value: text such as
/// `datetime('now')` sorts above every number, so its row was never due, held nothing back,
/// and the key's later rows went out while it stayed in the table, unsaid.
#[tokio::test]
async fn an_available_at_written_as_text_is_dead_lettered_saying_so() {
    let (_dir, store) = store().await;
    store
        .batch_execute(
            "INSERT INTO outbox (destination, partition_key, event_type, available_at)
               VALUES ('orders', 'k', 't', datetime('now', '-1 minute'));
             INSERT INTO outbox (destination, partition_key, event_type)
               VALUES ('orders', 'k', 't');",
        )
        .await
        .unwrap();
    let (events, reasons) = claim_and_settle(&store).await;
    assert_eq!(reasons.len(), 1, "{events:?} {reasons:?}");
    assert!(
        reasons[0].contains("available_at") && reasons[0].contains("milliseconds"),
        "{reasons:?}"
    );
    assert_eq!(events.len(), 1, "{events:?}");
}

/// Makes the outbox table at `path` as an application might by hand: the relay's columns,
/// with `nullable` left without their NOT NULL.
fn made_without_not_null(path: &std::path::Path, nullable: &[&str]) {
    let not_null = |column: &str| match nullable.contains(&column) {
        true => "",
        false => "NOT NULL",
    };
    let ddl = format!(
        "CREATE TABLE outbox (
            sequence_id   INTEGER PRIMARY KEY AUTOINCREMENT,
            event_id      TEXT {} UNIQUE,
            destination   TEXT {},
            partition_key TEXT,
            event_type    TEXT {},
            payload       TEXT,
            headers       TEXT {} DEFAULT '{{}}',
            mutation_id   TEXT,
            rejected      INTEGER NOT NULL DEFAULT 0,
            created_at    INTEGER {},
            available_at  INTEGER {} DEFAULT 0,
            attempts      INTEGER NOT NULL DEFAULT 0,
            last_error    TEXT,
            locked_by     TEXT,
            locked_until  INTEGER,
            delivered_at  INTEGER
        );",
        not_null("event_id"),
        not_null("destination"),
        not_null("event_type"),
        not_null("headers"),
        not_null("created_at"),
        not_null("available_at"),
    );
    rusqlite::Connection::open(path)
        .unwrap()
        .execute_batch(&ddl)
        .unwrap();
}

/// An outbox table made without the NOT NULLs (`check` calls it degraded and says such rows
/// go to the dead letters): a row with a NULL destination, type, event id or `created_at`
/// is undecodable, and its dead letter failed on the dead-letter table's NOT NULL every
/// time, the whole batch with it, the row's key stuck.
#[tokio::test]
async fn a_row_with_nulls_where_the_table_allows_them_is_dead_lettered() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("outbox.db");
    made_without_not_null(
        &path,
        &[
            "event_id",
            "destination",
            "event_type",
            "headers",
            "created_at",
        ],
    );
    let store = SqliteStore::open(&path, false).unwrap();
    store.migrate().await.unwrap();
    store
        .batch_execute(
            "INSERT INTO outbox (event_id, destination, partition_key, event_type, created_at) VALUES
               ('00000001-0000-4000-8000-000000000000', NULL, 'k1', 't', 1),
               ('00000002-0000-4000-8000-000000000000', 'orders', 'k2', NULL, 1),
               (NULL, 'orders', 'k3', 't', 1),
               ('00000004-0000-4000-8000-000000000000', 'orders', 'k4', 't', NULL),
               ('00000005-0000-4000-8000-000000000000', 'orders', 'k5', 't', 1)",
        )
        .await
        .unwrap();
    let (events, reasons) = claim_and_settle(&store).await;
    assert_eq!(events.len(), 1, "{events:?} {reasons:?}");
    assert_eq!(reasons.len(), 4, "{reasons:?}");
    let dead: i64 = rusqlite::Connection::open(&path)
        .unwrap()
        .query_row("SELECT count(*) FROM outbox_dead_letters", [], |r| r.get(0))
        .unwrap();
    assert_eq!(dead, 4);
}

/// An outbox table made without `available_at`'s NOT NULL: a row with NULL there was never
/// due (`NULL <= now` is not true), yet held nothing back, so its key's later rows went out
/// while it stayed in the table for good. A NULL `available_at` is due at once.
#[tokio::test]
async fn a_row_without_available_at_is_due_and_keeps_its_place_in_its_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("outbox.db");
    made_without_not_null(&path, &["available_at"]);
    let store = SqliteStore::open(&path, false).unwrap();
    store.migrate().await.unwrap();
    store
        .batch_execute(
            "INSERT INTO outbox (event_id, destination, partition_key, event_type, created_at,
                                 available_at) VALUES
               ('00000001-0000-4000-8000-000000000000', 'first', 'k', 't', 1, NULL),
               ('00000002-0000-4000-8000-000000000000', 'second', 'k', 't', 1, 0)",
        )
        .await
        .unwrap();
    let (events, reasons) = claim_and_settle(&store).await;
    let destinations: Vec<&str> = events.iter().map(|(d, _)| d.as_str()).collect();
    assert_eq!(destinations, ["first", "second"], "{reasons:?}");
}

/// Rows with a `created_at` the relay dead-letters (text, the smallest integer) broke the
/// reads around them: the backlog and `stats` read `min(created_at)` as an integer (an
/// error while the oldest was text) and subtracted it from now (an overflow: a panic in a
/// debug build, a wrong age in a release one); `event` failed on the very rows the dead
/// letter's reason tells the operator to look at.
#[tokio::test]
async fn odd_created_at_values_leave_the_backlog_stats_and_event_readable() {
    use outbox_core::store::Operations;
    use outbox_core::OutboxStore;
    let (_dir, store) = store().await;
    store
        .batch_execute(
            "INSERT INTO outbox (destination, partition_key, event_type, created_at)
               VALUES ('orders', 'k', 't', 'yesterday')",
        )
        .await
        .unwrap();
    store
        .backlog()
        .await
        .expect("backlog with a text created_at");
    store
        .batch_execute(
            "INSERT INTO outbox (destination, partition_key, event_type, created_at)
               VALUES ('orders', 'k2', 't', -9223372036854775808)",
        )
        .await
        .unwrap();
    let backlog = store.backlog().await.expect("backlog");
    assert_eq!(backlog.pending, 2);
    assert!(backlog.oldest_pending_age.is_some());
    let stats = store.destination_stats().await.expect("stats");
    assert_eq!(stats.len(), 1, "{stats:?}");
    let shown = store.event(1).await.expect("event").expect("row 1");
    assert_eq!(shown.created_at, None);
}

/// SQLite keeps a key written as bytes (`X'6b31'`: drivers bind Go's `[]byte`, Python's
/// `bytes`, a Node `Buffer` so) as a BLOB, which SQL never finds equal to the text `'k1'`;
/// the relay reads both as the key `k1`. A row of one form waiting to retry did not hold
/// back the key's later rows of the other, which went out first.
#[tokio::test]
async fn a_key_written_as_bytes_is_the_same_key_as_its_text() {
    use outbox_core::store::{ClaimRequest, LeaseHolder, RetryLater};
    use outbox_core::{NodeId, OutboxStore};
    use std::time::Duration;
    for (first, second) in [("X'6b31'", "'k1'"), ("'k1'", "X'6b31'")] {
        let (_dir, store) = store().await;
        store
            .batch_execute(&format!(
                "INSERT INTO outbox (destination, partition_key, event_type) VALUES
                   ('orders', {first}, 't'), ('orders', {second}, 't')"
            ))
            .await
            .unwrap();
        let node = NodeId("n1".into());
        let claim = || store.claim(ClaimRequest::new(node.clone(), 10, Duration::from_secs(30)));
        let claimed = claim().await.unwrap();
        assert_eq!(claimed.len(), 2, "{first} then {second}");
        let (head, next) = (claimed[0].sequence_id(), claimed[1].sequence_id());
        store
            .retry_later(
                LeaseHolder::unfenced(node.clone()),
                vec![RetryLater {
                    sequence_id: head,
                    attempts: 1,
                    error: "refused".into(),
                    delay: Duration::from_secs(60),
                }],
            )
            .await
            .unwrap();
        store.release(node.clone(), vec![next]).await.unwrap();
        let again = claim().await.unwrap();
        assert!(
            again.is_empty(),
            "{first} waits to retry, yet its key's later row {second} was claimed"
        );
    }
}
