//! Ordering keys longer than a btree index row (about 2.7 kB) on an outbox whose blocking
//! index an earlier version made over the key itself. (The long-key cases every store runs
//! are in the conformance suite, `outbox-testkit src/conformance/long_keys.rs`.)

use std::time::Duration;

use outbox_core::store::{ClaimRequest, LeaseHolder};
use outbox_core::{NodeId, OutboxStore};
use outbox_store_postgres::{PgOptions, PgStore, Tables};
use outbox_testkit::conformance::{keyed_event as event, long_key, payloads, retry};

use crate::session;

const PARTITIONS: u32 = 4;

async fn store() -> (PgStore, String) {
    let url = outbox_testkit::fresh_pg_database().await;
    let mut tables = Tables::standard();
    tables.partition_count = PARTITIONS;
    let store = PgStore::new(PgOptions::new(url.as_str(), tables)).unwrap();
    store.migrate().await.unwrap();
    (store, url)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outbox_migrated_by_an_earlier_version_keeps_its_key_order_until_migrate_replaces_the_index(
) {
    let (store, url) = store().await;
    let client = session(&url).await;
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
            LeaseHolder::unfenced(node.clone()),
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
    store.insert(vec![event(&long_key('a'), 3)]).await.unwrap();
    assert_eq!(payloads(&store.claim(claim()).await.unwrap()), ["3"]);
}

/// A relay of the first wave, run with `--auto-migrate` during a rolling upgrade, creates
/// the key index again on a schema at the latest version. `migrate` ran only the steps
/// after the recorded version, so it left the index while `check` told to run it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_drops_the_key_index_an_older_relay_made_again() {
    let (store, url) = store().await;
    let client = session(&url).await;
    client
        .batch_execute(
            "CREATE INDEX IF NOT EXISTS outbox_blocking_idx ON outbox ((coalesce(partition_key, destination)), sequence_id)
                 WHERE delivered_at IS NULL AND (locked_by IS NOT NULL OR attempts > 0);",
        )
        .await
        .unwrap();
    assert_eq!(store.verify().await.unwrap().len(), 1);
    store.migrate().await.unwrap();
    let gone: bool = client
        .query_one("SELECT to_regclass('outbox_blocking_idx') IS NULL", &[])
        .await
        .unwrap()
        .get(0);
    assert!(gone, "the key index is still there after migrate");
    assert_eq!(store.verify().await.unwrap(), []);
}
