//! The store conformance suite against SQLite files.

use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use futures::FutureExt;
use outbox_core::store::NodeRegistry;
use outbox_core::{OutboxStore, SequenceId};
use outbox_store_sqlite::SqliteStore;
use std::time::{Duration, UNIX_EPOCH};

use outbox_testkit::conformance::{DeadRow, Expect, Harness, OddTime, RenamedColumn};
use rusqlite::Connection;

struct SqliteHarness {
    _dir: tempfile::TempDir,
    store: SqliteStore,
    retaining: SqliteStore,
    conn: Mutex<Connection>,
}

async fn new_harness() -> SqliteHarness {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("outbox.db");
    let store = SqliteStore::open(&path, false).unwrap();
    store.migrate().await.unwrap();
    let conn = Connection::open(&path).unwrap();
    conn.busy_timeout(std::time::Duration::from_secs(10))
        .unwrap();
    SqliteHarness {
        retaining: SqliteStore::open(&path, true).unwrap(),
        store,
        conn: Mutex::new(conn),
        _dir: dir,
    }
}

impl Harness for SqliteHarness {
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
        let conn = self.conn.lock().unwrap();
        conn.execute_batch(&format!(
            "BEGIN; INSERT INTO outbox (destination, event_type, payload) VALUES ('{destination}', 't', '1'); ROLLBACK;"
        ))
        .unwrap();
        async {}.boxed()
    }

    fn insert_undecodable(&self, destination: &str) -> BoxFuture<'_, SequenceId> {
        let conn = self.conn.lock().unwrap();
        let id = conn
            .query_row(
                "INSERT INTO outbox (destination, event_type, payload, headers)
                 VALUES (?1, 't', '{}', '[\"not\", \"an object\"]') RETURNING sequence_id",
                [destination],
                |r| r.get(0),
            )
            .unwrap();
        async move { id }.boxed()
    }

    fn row_state(&self, id: SequenceId) -> BoxFuture<'_, Option<(i64, Option<String>, bool)>> {
        let conn = self.conn.lock().unwrap();
        let state = conn
            .query_row(
                "SELECT attempts, last_error, delivered_at IS NOT NULL FROM outbox WHERE sequence_id = ?1",
                [id],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .ok();
        async move { state }.boxed()
    }

    fn table(&self) -> &str {
        "outbox"
    }

    fn execute<'a>(&'a self, sql: &'a str) -> BoxFuture<'a, ()> {
        self.conn.lock().unwrap().execute_batch(sql).unwrap();
        async {}.boxed()
    }

    /// A trigger's RAISE: the relay's connections do not turn foreign keys on.
    fn refuse_deleting(&self, id: Option<SequenceId>) -> BoxFuture<'_, ()> {
        let sql = match id {
            Some(id) => format!(
                "CREATE TRIGGER refuse_delete BEFORE DELETE ON outbox
                   WHEN OLD.sequence_id = {id}
                   BEGIN SELECT RAISE(ABORT, 'an order refers to this event'); END;"
            ),
            None => "DROP TRIGGER refuse_delete".into(),
        };
        self.conn.lock().unwrap().execute_batch(&sql).unwrap();
        async {}.boxed()
    }

    /// `created_at` is milliseconds since 1970; SQLite holds any integer, or text.
    fn odd_created_at(&self) -> Vec<OddTime> {
        const OUTSIDE: &str = "outside the years 1 to 9999";
        let row = |destination, sql, expect| OddTime {
            destination,
            sql,
            expect,
        };
        let moon = UNIX_EPOCH - Duration::from_secs(14_182_940);
        let ok = UNIX_EPOCH + Duration::from_millis(1_700_000_000_123);
        vec![
            row("moon", "-14182940000", Expect::Delivered(Some(moon))),
            row(
                "max",
                "9223372036854775807",
                Expect::DeadLettered(&[OUTSIDE, "created_at is 9223372036854775807 milliseconds"]),
            ),
            row(
                "min",
                "-9223372036854775808",
                Expect::DeadLettered(&[OUTSIDE]),
            ),
            row("far", "253402300800000", Expect::DeadLettered(&[OUTSIDE])),
            row(
                "text",
                "'yesterday'",
                Expect::DeadLettered(&["created_at is Text, not an integer"]),
            ),
            row("ok", "1700000000123", Expect::Delivered(Some(ok))),
        ]
    }

    fn renamed_column(&self) -> RenamedColumn {
        RenamedColumn {
            what: "column mutation_id of table outbox is missing",
            fix: "RENAME COLUMN",
        }
    }

    fn dead_rows(&self) -> BoxFuture<'_, Vec<DeadRow>> {
        let conn = self.conn.lock().unwrap();
        let mut stmt = conn
            .prepare("SELECT sequence_id, attempts, last_error, payload FROM outbox_dead_letters ORDER BY sequence_id")
            .unwrap();
        let rows = stmt
            .query_map([], |r| {
                Ok(DeadRow {
                    sequence_id: r.get(0)?,
                    attempts: r.get(1)?,
                    last_error: r.get(2)?,
                    payload: r.get(3)?,
                })
            })
            .unwrap()
            .collect::<Result<Vec<_>, _>>()
            .unwrap();
        async move { rows }.boxed()
    }
}

outbox_testkit::store_conformance!(new_harness;
    long_keys: run,
    owned_partitions: not_applicable("SQLite has no partition leases: the relays sharing a file claim under row leases"),
    created_at: run,
    renamed_column: run,
    row_locks: not_applicable("SQLite locks the whole database, not rows: a transaction holding it keeps every claim waiting"));

/// Dead letters have a table of their own here, so one whose event the application wrote
/// again collides with it: see the case's own account.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_retry_leaves_a_dead_letter_whose_event_came_back() {
    let harness = new_harness().await;
    outbox_testkit::conformance::operator_retry_leaves_a_dead_letter_whose_event_came_back(
        &harness,
    )
    .await;
}
