//! The store conformance suite against MariaDB (Debian's package; no MySQL 8 server can be
//! installed here), native layout, one fresh database per test.

use std::sync::Arc;

use futures::future::BoxFuture;
use futures::FutureExt;
use mysql_async::prelude::Queryable;
use outbox_core::store::NodeRegistry;
use outbox_core::{OutboxStore, SequenceId};
use outbox_layout::Mapping;
use outbox_store_mysql::{MySqlOptions, MySqlStore};
use std::time::{Duration, UNIX_EPOCH};

use outbox_testkit::conformance::{DeadRow, Expect, Harness, OddTime, RenamedColumn};

struct MySqlHarness {
    store: MySqlStore,
    retaining: MySqlStore,
    pool: mysql_async::Pool,
    /// A session of its own, holding a row locked for the `row_locks` case.
    locker: tokio::sync::Mutex<Option<mysql_async::Conn>>,
}

fn store(url: &str, retain: bool) -> MySqlStore {
    MySqlStore::new(MySqlOptions {
        url: url.to_string(),
        mapping: Mapping::native_mysql(None, "outbox", retain),
        layout: "native".into(),
        max_attempts: 20,
        pool_size: 8,
        nodes_table: Some("outbox_nodes".into()),
        operation_timeout: None,
    })
    .unwrap()
}

async fn new_harness() -> MySqlHarness {
    let url = outbox_testkit::fresh_mysql_database().await;
    let s = store(&url, false);
    s.migrate().await.unwrap();
    MySqlHarness {
        retaining: store(&url, true),
        store: s,
        pool: mysql_async::Pool::new(url.as_str()),
        locker: tokio::sync::Mutex::new(None),
    }
}

impl Harness for MySqlHarness {
    fn store(&self) -> Arc<dyn OutboxStore> {
        Arc::new(self.store.clone())
    }

    fn retaining_store(&self) -> Arc<dyn OutboxStore> {
        Arc::new(self.retaining.clone())
    }

    fn registry(&self) -> Arc<dyn NodeRegistry> {
        Arc::new(self.store.clone())
    }

    fn operations(&self) -> Arc<dyn outbox_core::store::Operations> {
        Arc::new(self.store.clone())
    }

    fn insert_rolled_back(&self, destination: &str) -> BoxFuture<'_, ()> {
        let destination = destination.to_string();
        async move {
            let mut conn = self.pool.get_conn().await.unwrap();
            let mut tx = conn
                .start_transaction(mysql_async::TxOpts::default())
                .await
                .unwrap();
            tx.exec_drop(
                "INSERT INTO outbox (destination, event_type, payload) VALUES (?, 't', '1')",
                (destination,),
            )
            .await
            .unwrap();
            tx.rollback().await.unwrap();
        }
        .boxed()
    }

    fn insert_undecodable(&self, destination: &str) -> BoxFuture<'_, SequenceId> {
        let destination = destination.to_string();
        async move {
            let mut conn = self.pool.get_conn().await.unwrap();
            conn.exec_drop(
                "INSERT INTO outbox (destination, event_type, payload, headers) VALUES (?, 't', '{}', '[\"not\", \"an object\"]')",
                (destination,),
            )
            .await
            .unwrap();
            conn.last_insert_id().unwrap() as i64
        }
        .boxed()
    }

    fn row_state(&self, id: SequenceId) -> BoxFuture<'_, Option<(i64, Option<String>, bool)>> {
        async move {
            let mut conn = self.pool.get_conn().await.unwrap();
            // Dead rows stay in the table on MySQL (dead_at set) but are out of the queue.
            conn.exec_first(
                "SELECT attempts, last_error, delivered_at IS NOT NULL FROM outbox WHERE sequence_id = ? AND dead_at IS NULL",
                (id,),
            )
            .await
            .unwrap()
            .map(|(a, e, d): (i64, Option<String>, i64)| (a, e, d != 0))
        }
        .boxed()
    }

    fn table(&self) -> &str {
        "outbox"
    }

    fn execute<'a>(&'a self, sql: &'a str) -> BoxFuture<'a, ()> {
        async move {
            let mut conn = self.pool.get_conn().await.unwrap();
            conn.query_drop(sql).await.unwrap();
        }
        .boxed()
    }

    fn lock_row_elsewhere(&self, id: Option<SequenceId>) -> BoxFuture<'_, ()> {
        async move {
            let mut locker = self.locker.lock().await;
            match id {
                Some(id) => {
                    let mut conn = self.pool.get_conn().await.unwrap();
                    conn.query_drop(format!(
                        "BEGIN; SELECT 1 FROM outbox WHERE sequence_id = {id} FOR UPDATE"
                    ))
                    .await
                    .unwrap();
                    *locker = Some(conn);
                }
                None => {
                    let mut conn = locker.take().expect("a row locked");
                    conn.query_drop("COMMIT").await.unwrap();
                }
            }
        }
        .boxed()
    }

    /// A trigger's SIGNAL, as MariaDB's foreign keys need the referencing column's exact type.
    fn refuse_deleting(&self, id: Option<SequenceId>) -> BoxFuture<'_, ()> {
        let sql = match id {
            Some(id) => format!(
                "CREATE TRIGGER refuse_delete BEFORE DELETE ON outbox FOR EACH ROW
                 IF OLD.sequence_id = {id} THEN
                   SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'an order refers to this event';
                 END IF"
            ),
            None => "DROP TRIGGER refuse_delete".into(),
        };
        async move {
            let mut conn = self.pool.get_conn().await.unwrap();
            conn.query_drop(sql).await.unwrap();
        }
        .boxed()
    }

    /// `created_at` is a `datetime(6)`: MariaDB refuses a time outside the years 1000 to 9999
    /// at insert, so only the early ones are odd here.
    fn odd_created_at(&self) -> Vec<OddTime> {
        let moon = UNIX_EPOCH - Duration::from_secs(14_182_940);
        vec![
            OddTime {
                destination: "moon",
                sql: "'1969-07-20 20:17:40'",
                expect: Expect::Delivered(Some(moon)),
            },
            OddTime {
                destination: "ok",
                sql: "NOW(6)",
                expect: Expect::Delivered(None),
            },
        ]
    }

    fn renamed_column(&self) -> RenamedColumn {
        RenamedColumn {
            what: "has no column \"mutation_id\"",
            fix: "outbox-relay migrate",
        }
    }

    fn dead_rows(&self) -> BoxFuture<'_, Vec<DeadRow>> {
        async move {
            let mut conn = self.pool.get_conn().await.unwrap();
            conn.query_map(
                "SELECT sequence_id, attempts, last_error, CAST(payload AS CHAR) FROM outbox WHERE dead_at IS NOT NULL ORDER BY sequence_id",
                |(sequence_id, attempts, last_error, payload): (i64, i64, String, Option<String>)| DeadRow {
                    sequence_id,
                    attempts,
                    last_error,
                    payload,
                },
            )
            .await
            .unwrap()
        }
        .boxed()
    }
}

outbox_testkit::store_conformance!(new_harness;
    long_keys: not_applicable("the native table's partition_key holds 255 characters: a longer key is refused at insert with the fix (a_10kb_key_is_refused_at_insert_with_the_fix below)"),
    owned_partitions: not_applicable("MySQL has no partition leases: one active relay per table"),
    created_at: run,
    renamed_column: run,
    row_locks: run);

/// Ordering keys longer than the native table's column. The key is not indexed on MySQL
/// (blocked keys are passed to the claim as values), so no index row limit applies; the
/// native column refuses what it cannot hold, and the error says what to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_10kb_key_is_refused_at_insert_with_the_fix() {
    let url = outbox_testkit::fresh_mysql_database().await;
    let store = store(&url, false);
    store.migrate().await.unwrap();
    let error = store
        .insert(vec![outbox_core::NewEvent {
            destination: "d".into(),
            partition_key: Some("k".repeat(10_240)),
            event_type: "t".into(),
            payload: Some("1".into()),
            ..outbox_core::NewEvent::default()
        }])
        .await
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("Data too long for column 'partition_key'")
            && error.contains("hash of a longer one")
            && error.contains("MODIFY partition_key text"),
        "{error}"
    );
    assert_eq!(
        store.backlog().await.unwrap().pending,
        0,
        "nothing half-written"
    );
}

/// `prune` picks its rows with one statement and deletes them with another. A row that
/// `replay` made pending in between (here a replay's update, committed while the delete
/// waits on its lock) was deleted all the same: the replayed event, lost. The delete
/// checks the condition again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_keeps_a_row_replayed_between_its_pick_and_its_delete() {
    use outbox_core::store::{ClaimRequest, LeaseHolder, Operations};
    let url = outbox_testkit::fresh_mysql_database().await;
    let store = store(&url, true);
    store.migrate().await.unwrap();
    let ids = store
        .insert(vec![outbox_core::NewEvent {
            destination: "d".into(),
            event_type: "t".into(),
            payload: Some("1".into()),
            ..outbox_core::NewEvent::default()
        }])
        .await
        .unwrap();
    let node = outbox_core::NodeId::random();
    let claimed = store
        .claim(ClaimRequest::new(node.clone(), 10, Duration::from_secs(30)))
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1);
    store
        .ack(LeaseHolder::unfenced(node), ids.clone())
        .await
        .unwrap();
    let pool = mysql_async::Pool::new(url.as_str());
    let mut conn = pool.get_conn().await.unwrap();
    conn.query_drop("UPDATE outbox SET delivered_at = UTC_TIMESTAMP(6) - INTERVAL 10 DAY")
        .await
        .unwrap();
    // A replay of the row, not yet committed.
    let mut replay = pool.get_conn().await.unwrap();
    replay.query_drop("BEGIN").await.unwrap();
    replay
        .query_drop("UPDATE outbox SET delivered_at = NULL")
        .await
        .unwrap();
    let pruning = tokio::spawn({
        let store = store.clone();
        async move {
            let week_ago = std::time::SystemTime::now() - Duration::from_secs(7 * 86_400);
            store.prune_delivered(week_ago, 1000).await
        }
    });
    // The prune's delete waits on the replay's lock.
    until_a_delete_waits(&mut conn).await;
    replay.query_drop("COMMIT").await.unwrap();
    assert_eq!(pruning.await.unwrap().unwrap(), 0, "nothing pruned");
    let left: Option<i64> = conn
        .query_first("SELECT count(*) FROM outbox WHERE delivered_at IS NULL")
        .await
        .unwrap();
    assert_eq!(left, Some(1), "the replayed row is still there");
}

/// `dead purge` picked the dead rows with one statement and deleted them by id with
/// another. A row that `dead retry` made pending in between (here the retry's update,
/// committed while the purge's delete waits on its lock) was deleted all the same, though
/// the retry had said it would go out again. The delete checks again that the row is dead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_purge_keeps_a_row_retried_between_its_pick_and_its_delete() {
    use outbox_core::store::{DeadSelector, Operations};
    let url = outbox_testkit::fresh_mysql_database().await;
    let store = store(&url, false);
    store.migrate().await.unwrap();
    let pool = mysql_async::Pool::new(url.as_str());
    let mut conn = pool.get_conn().await.unwrap();
    conn.query_drop(
        "INSERT INTO outbox (destination, event_type, payload, attempts, last_error, dead_at)
         VALUES ('d', 't', '1', 20, 'refused', UTC_TIMESTAMP(6))",
    )
    .await
    .unwrap();
    // A retry of the dead row, not yet committed.
    let mut retry = pool.get_conn().await.unwrap();
    retry.query_drop("BEGIN").await.unwrap();
    retry
        .query_drop("UPDATE outbox SET dead_at = NULL, attempts = 0")
        .await
        .unwrap();
    let purging = tokio::spawn({
        let store = store.clone();
        async move { store.dead_purge(DeadSelector::All).await }
    });
    until_a_delete_waits(&mut conn).await;
    retry.query_drop("COMMIT").await.unwrap();
    assert_eq!(purging.await.unwrap().unwrap(), 0, "nothing purged");
    let left: Option<i64> = conn
        .query_first("SELECT count(*) FROM outbox WHERE dead_at IS NULL")
        .await
        .unwrap();
    assert_eq!(left, Some(1), "the retried row is still there");
}

/// Until another session's DELETE is running (waiting on a lock the test holds).
async fn until_a_delete_waits(conn: &mut mysql_async::Conn) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let waiting: Option<i64> = conn
            .query_first(
                "SELECT count(*) FROM information_schema.PROCESSLIST
                  WHERE ID <> CONNECTION_ID() AND INFO LIKE 'DELETE%'",
            )
            .await
            .unwrap();
        if waiting == Some(1) {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "no delete waiting");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// An application whose session is not in UTC (`SET time_zone`, a driver's setting, a server
/// in local time) inserts with the table's defaults. `created_at` and `available_at` took
/// its local time, the relay compares them with UTC: at UTC+2 every event was held back two
/// hours (and a drain called them inserted after it began, and exited 0).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_inserted_in_another_time_zone_is_claimed_at_once() {
    use outbox_core::store::ClaimRequest;
    let url = outbox_testkit::fresh_mysql_database().await;
    let store = store(&url, false);
    store.migrate().await.unwrap();
    let pool = mysql_async::Pool::new(url.as_str());
    let mut app = pool.get_conn().await.unwrap();
    app.query_drop("SET time_zone = '+02:00'").await.unwrap();
    app.query_drop("INSERT INTO outbox (destination, event_type, payload) VALUES ('d', 't', '1')")
        .await
        .unwrap();
    let claimed = store
        .claim(ClaimRequest::new(
            outbox_core::NodeId::random(),
            10,
            Duration::from_secs(30),
        ))
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1, "held back by the session's offset");
}

/// A key's head waits to retry; the relay stops (a deploy, kill -9) or a standby takes the
/// table over. The wait was kept in the old relay's memory alone, so the new active relay
/// claimed the key's next row and delivered it before the retry: out of order. It now
/// loads the keys the table shows waiting when it takes the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_waiting_to_retry_stays_blocked_for_the_next_active_relay() {
    use outbox_core::store::{ClaimRequest, LeaseHolder, RetryLater};
    let url = outbox_testkit::fresh_mysql_database().await;
    let first = store(&url, false);
    first.migrate().await.unwrap();
    let event = |n: i32| outbox_core::NewEvent {
        destination: "d".into(),
        partition_key: Some("k".into()),
        event_type: "t".into(),
        payload: Some(n.to_string()),
        ..outbox_core::NewEvent::default()
    };
    let ids = first.insert(vec![event(1), event(2)]).await.unwrap();
    let node = outbox_core::NodeId::random();
    let request =
        |node: &outbox_core::NodeId| ClaimRequest::new(node.clone(), 10, Duration::from_secs(30));
    assert_eq!(first.claim(request(&node)).await.unwrap().len(), 2);
    let retry = RetryLater {
        sequence_id: ids[0],
        attempts: 1,
        error: "the broker is down".into(),
        delay: Duration::from_secs(60),
    };
    first
        .retry_later(LeaseHolder::unfenced(node.clone()), vec![retry])
        .await
        .unwrap();
    first.release(node, vec![ids[1]]).await.unwrap();
    first.step_down().await;
    let next = store(&url, false);
    let claimed = next
        .claim(request(&outbox_core::NodeId::random()))
        .await
        .unwrap();
    assert!(
        claimed.is_empty(),
        "the key's later row was claimed ahead of its retry: {:?}",
        claimed.iter().map(|c| c.sequence_id()).collect::<Vec<_>>()
    );
}

/// Destinations and types are matched byte for byte, as PostgreSQL and SQLite match them:
/// under the connection's collation `dead purge --destination orders` deleted the dead
/// letters of `Orders` and `ördérs` too, and `dead list --type` listed other types.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_commands_match_destinations_and_types_exactly() {
    use outbox_core::store::{DeadQuery, DeadSelector, Operations};
    let url = outbox_testkit::fresh_mysql_database().await;
    let store = store(&url, false);
    store.migrate().await.unwrap();
    let mut conn = mysql_async::Conn::from_url(url.as_str()).await.unwrap();
    for (destination, event_type) in [("orders", "paid"), ("Orders", "Paid"), ("ördérs", "páid")]
    {
        conn.exec_drop(
            "INSERT INTO outbox (destination, event_type, payload, attempts, last_error, dead_at)
             VALUES (?, ?, '1', 20, 'refused', UTC_TIMESTAMP(6))",
            (destination, event_type),
        )
        .await
        .unwrap();
    }
    let listed = store
        .dead_list(DeadQuery {
            event_type: Some("paid".into()),
            limit: 100,
            ..DeadQuery::default()
        })
        .await
        .unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    let purged = store
        .dead_purge(DeadSelector::Destination("orders".into()))
        .await
        .unwrap();
    assert_eq!(purged, 1);
    let left: Vec<String> = conn
        .query("SELECT destination FROM outbox ORDER BY sequence_id")
        .await
        .unwrap();
    assert_eq!(left, ["Orders", "ördérs"]);
}

/// A mapped table's `last_error` narrower than an error (here `varchar(20)`, as custom
/// tables have it): the server refused the retry (strict mode), every time, and the row
/// stayed leased, its key stuck. The error is cut to what the column holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_longer_than_last_error_holds_is_cut_to_fit() {
    use outbox_core::store::{ClaimRequest, LeaseHolder, RetryLater};
    use outbox_core::NodeId;
    let url = outbox_testkit::fresh_mysql_database().await;
    let store = store(&url, false);
    store.migrate().await.unwrap();
    let mut conn = mysql_async::Conn::from_url(url.as_str()).await.unwrap();
    conn.query_drop("ALTER TABLE outbox MODIFY last_error varchar(20) NULL")
        .await
        .unwrap();
    store
        .insert(vec![outbox_testkit::conformance::keyed_event("k", 0)])
        .await
        .unwrap();
    let node = NodeId("n".into());
    let claimed = store
        .claim(ClaimRequest::new(node.clone(), 10, Duration::from_secs(30)))
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1);
    let retried = store
        .retry_later(
            LeaseHolder::unfenced(node),
            vec![RetryLater {
                sequence_id: claimed[0].sequence_id(),
                attempts: 1,
                error: "é".repeat(300),
                delay: Duration::from_millis(10),
            }],
        )
        .await
        .unwrap();
    assert_eq!(retried, 1);
    let stored: Option<String> = conn
        .query_first("SELECT last_error FROM outbox")
        .await
        .unwrap();
    assert_eq!(stored, Some("é".repeat(20)));
}

/// A key whose head waits to retry holds back that key alone. MySQL compared keys under the
/// connection's collation, so `order-1` waiting held back `ORDER-1` and `order-1 ` too, for
/// as long as its retries lasted: in the relay's claims, and in the next active relay's,
/// which reads the waiting keys from the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_waiting_to_retry_holds_back_no_key_its_collation_calls_equal() {
    use outbox_core::store::{ClaimRequest, LeaseHolder, RetryLater};
    let url = outbox_testkit::fresh_mysql_database().await;
    let first = store(&url, false);
    first.migrate().await.unwrap();
    let event = |key: &str| outbox_core::NewEvent {
        destination: "d".into(),
        partition_key: Some(key.into()),
        event_type: "t".into(),
        payload: Some("1".into()),
        ..outbox_core::NewEvent::default()
    };
    let keys = ["order-1", "order-1", "ORDER-1", "order-1 ", "ördér-1"];
    let ids = first
        .insert(keys.iter().map(|k| event(k)).collect())
        .await
        .unwrap();
    let node = outbox_core::NodeId::random();
    let request =
        |node: &outbox_core::NodeId| ClaimRequest::new(node.clone(), 10, Duration::from_secs(30));
    assert_eq!(first.claim(request(&node)).await.unwrap().len(), keys.len());
    let retry = RetryLater {
        sequence_id: ids[0],
        attempts: 1,
        error: "the broker is down".into(),
        delay: Duration::from_secs(60),
    };
    first
        .retry_later(LeaseHolder::unfenced(node.clone()), vec![retry])
        .await
        .unwrap();
    first
        .release(node.clone(), ids[1..].to_vec())
        .await
        .unwrap();
    let claimed_keys = |claimed: Vec<outbox_core::Claimed>| {
        let mut keys: Vec<String> = claimed
            .iter()
            .map(|c| c.ordering_key().to_string())
            .collect();
        keys.sort();
        keys
    };
    let others = ["ORDER-1", "order-1 ", "ördér-1"];
    assert_eq!(
        claimed_keys(first.claim(request(&node)).await.unwrap()),
        others,
        "this relay's claim"
    );
    first.release(node, ids[2..].to_vec()).await.unwrap();
    first.step_down().await;
    let next = store(&url, false);
    assert_eq!(
        claimed_keys(
            next.claim(request(&outbox_core::NodeId::random()))
                .await
                .unwrap()
        ),
        others,
        "the next active relay's claim"
    );
}
