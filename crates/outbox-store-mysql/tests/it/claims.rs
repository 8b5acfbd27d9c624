//! What a claim costs the rows it does not take, against real MariaDB.

use std::time::Duration;

use mysql_async::prelude::Queryable;
use outbox_core::store::ClaimRequest;
use outbox_core::{NodeId, OutboxStore};

use crate::native_store;

/// Rows scheduled for later (or waiting out a retry) ahead of the due ones: one locking
/// read over the claim's condition locked every row it passed, and MariaDB kept those locks
/// to the commit. 300,000 scheduled rows cost 600,000 locks a claim, the application's
/// updates of them waited on the relay, and the server aborted when the locks filled its
/// buffer pool. The claim now locks the rows it found claimable alone. A trigger on the
/// claim's mark records how many rows its transaction holds locked at that moment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_locks_no_row_scheduled_for_later() {
    let url = outbox_testkit::fresh_mysql_database().await;
    let store = native_store(&url, None);
    store.migrate().await.unwrap();
    let mut conn = mysql_async::Conn::from_url(url.as_str()).await.unwrap();
    conn.query_drop(
        "INSERT INTO outbox (destination, partition_key, event_type, payload, available_at)
         SELECT 'later', CONCAT('s', seq % 100), 't', '{}', UTC_TIMESTAMP(6) + INTERVAL 1 DAY
           FROM seq_1_to_20000",
    )
    .await
    .unwrap();
    conn.query_drop(
        "INSERT INTO outbox (destination, partition_key, event_type, payload)
         VALUES ('now', 'k', 't', '{}')",
    )
    .await
    .unwrap();
    conn.query_drop("CREATE TABLE claim_locks (n bigint NOT NULL)")
        .await
        .unwrap();
    conn.query_drop(
        "CREATE TRIGGER claim_locks_at_mark BEFORE UPDATE ON outbox FOR EACH ROW
         INSERT INTO claim_locks
         SELECT trx_rows_locked FROM information_schema.INNODB_TRX
          WHERE trx_mysql_thread_id = CONNECTION_ID()",
    )
    .await
    .unwrap();
    let node = NodeId::random();
    let claimed = store
        .claim(ClaimRequest::new(node, 100, Duration::from_secs(30)))
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1, "the due row alone: {claimed:?}");
    let locked: Option<i64> = conn
        .query_first("SELECT CAST(MAX(n) AS SIGNED) FROM claim_locks")
        .await
        .unwrap();
    let locked = locked.expect("the trigger ran at the claim's mark");
    // The due row, in the primary key and the index the claim read.
    assert!(
        locked <= 4,
        "the claim's transaction held {locked} row locks for the one row it took"
    );
}
